/* Chinese search. The index is built with jieba (Sphinx's Chinese splitter, plus the course's term
 * list in _ext/zh_terms.txt), but Sphinx's search page splits the query only at spaces and
 * punctuation, so "梯度累积的原理" would be looked up as one word that no page contains.
 *
 * Each run of CJK characters in the query is cut into the longest words the index knows (forward
 * maximum matching over the index's own terms); characters that form no indexed word (particles
 * such as 的, 和) are dropped, as jieba's single characters are never indexed. Latin words are
 * left as Sphinx splits them.
 */
(() => {
  const CJK = /[\u2e80-\u9fff\uf900-\ufaff]+/gu;
  const MAXLEN = 8;
  const known = (w) => {
    // searchtools.js declares `const Search` (a global binding, not a window property)
    const ix = typeof Search !== "undefined" ? Search._index : null;
    if (!ix) return true;
    return Object.prototype.hasOwnProperty.call(ix.terms, w) ||
      Object.prototype.hasOwnProperty.call(ix.titleterms, w);
  };
  const cut = (run) => {
    if (known(run)) return [run];
    const out = [];
    let i = 0;
    while (i < run.length) {
      let j = Math.min(run.length, i + MAXLEN);
      while (j > i + 1 && !known(run.slice(i, j))) j -= 1;
      if (j > i + 1) out.push(run.slice(i, j));
      i = j;
    }
    return out.length ? out : [run];
  };
  const basic = (q) => q.split(/[^\p{Letter}\p{Number}_\p{Emoji_Presentation}]+/gu).filter((t) => t);
  window.splitQuery = (query) => {
    const terms = [];
    basic(query).forEach((term) => {
      if (!term.match(CJK)) { terms.push(term); return; }
      // a term may mix scripts ("LoRA的秩"): keep the Latin parts, cut the CJK runs
      let last = 0;
      for (const m of term.matchAll(CJK)) {
        if (m.index > last) terms.push(term.slice(last, m.index));
        terms.push(...cut(m[0]));
        last = m.index + m[0].length;
      }
      if (last < term.length) terms.push(term.slice(last));
    });
    return terms;
  };
})();
