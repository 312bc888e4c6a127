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

/* Ranking, duplicates and snippets of the search page.
 *
 * Sphinx scores a page by whether a word occurs in it at all (5, or 15 in a section title) and
 * breaks ties by title, so the summary chapter, which names every term, came first for every
 * query. Here each page found is scored again with BM25 over its prose (term counts and page
 * lengths that _ext/course_ui.py writes to _static/course-search-data.js at build time), plus a
 * bonus when the page's own title holds the word (more for the first such chapter: the one that
 * introduces it): the chapter that teaches a term comes first.
 * A page is listed once (its best entry: a matching section when there is one).
 *
 * Snippets come from the prose only: the article without code cells, outputs, the page header
 * (download/menu buttons, "目录"), navigation, permalinks and the calculator's form; inline TeX (\(w\)) is shown as
 * text (w). */
(() => {
  const K1 = 1.2;
  const B = 0.75;
  const TITLE_BONUS = 4;
  const CJK_WORD = /^[\u2e80-\u9fff\uf900-\ufaff]+$/u;
  const data = () => window.COURSE_SEARCH;

  const bm25 = (d, word, doc) => {
    const postings = d.tf[word];
    if (!postings) return 0;
    const i = d.docs.indexOf(doc);
    const tf = i < 0 ? 0 : postings[i] || 0;
    if (!tf) return 0;
    const n = Object.keys(postings).length;
    const idf = Math.log(1 + (d.docs.length - n + 0.5) / (n + 0.5));
    const norm = 1 - B + B * (d.len[i] / d.avg);
    return (idf * tf * (K1 + 1)) / (tf + K1 * norm);
  };

  // a word in a page's title: that page is about it; in one of its section titles or the
  // bold words opening a paragraph (a definition; `heads`, written by _ext/course_ui.py): it
  // teaches it. The page that introduces a word gets a further bonus: the first chapter in
  // reading order whose title holds it, else the first chapter whose headings do, else the
  // first page whose title does (a lab practises what a chapter teaches: "损失缩放" is in
  // lab 2's title, chapter 2 teaches it under a heading). The root page's title is the
  // book's and names everything: no bonus. A small prior for the earlier page decides near
  // ties.
  // A compound query word the index also knows in parts ("梯度检查点": 梯度, 检查点; jieba
  // indexes both) also scores its parts, at half weight: a chapter that says "激活检查点"
  // sixty times is about the compound too.
  const FIRST_TITLE_BONUS = 2;
  const SECTION_BONUS = 3;
  const PART_WEIGHT = 0.5;
  const ORDER_PRIOR = 0.5;
  const titled = (d, i, q) => d.docs[i] !== d.root && d.titles[i].toLowerCase().includes(q);
  const headed = (d, i, q) =>
    d.docs[i] !== d.root && !!d.heads && d.heads[i].toLowerCase().includes(q);
  const chapter = (d, i) => /^book\/\d/.test(d.docs[i]);
  const introducer = (d, q) => {
    const first = (test) => d.docs.findIndex((_, j) => test(j));
    let i = first((j) => chapter(d, j) && titled(d, j, q));
    if (i < 0) i = first((j) => chapter(d, j) && headed(d, j, q));
    if (i < 0) i = first((j) => titled(d, j, q));
    return i;
  };
  const parts = (d, w) => {
    if (!w.match(CJK_WORD) || w.length < 3) return [];
    const out = [];
    let i = 0;
    while (i < w.length) {
      let j = Math.min(w.length, i + 8, i === 0 ? w.length - 1 : w.length);
      while (j > i + 1 && !d.tf[w.slice(i, j)]) j -= 1;
      if (j > i + 1) out.push(w.slice(i, j));
      i = Math.max(j, i + 1);
    }
    return out;
  };
  // a word and the book's other words for the same thing (_ext/zh_synonyms.txt: "梯度检查点"
  // is what chapter 4 titles "激活检查点")
  const forms = (d, w) => [w, ...((d.synonyms && d.synonyms[w]) || [])];
  const rank = (d, doc, words) => {
    const i = d.docs.indexOf(doc);
    if (i < 0) return 0;
    let s = ORDER_PRIOR * (1 - i / d.docs.length);
    words.forEach((w) => {
      const all = forms(d, w);
      s += Math.max(...all.map((f) => bm25(d, f, doc)));
      parts(d, w).forEach((p) => { s += PART_WEIGHT * bm25(d, p, doc); });
      if (all.some((f) => titled(d, i, f))) s += TITLE_BONUS;
      else if (all.some((f) => headed(d, i, f))) s += SECTION_BONUS;
      const first = all.map((f) => introducer(d, f)).filter((j) => j >= 0);
      if (first.length && Math.min(...first) === i) s += FIRST_TITLE_BONUS;
    });
    return s;
  };

  const patch = () => {
  if (typeof Search === "undefined" || Search._course) return;
  Search._course = true;
  const performSearch = Search._performSearch;
  Search._performSearch = (query, searchTerms, excludedTerms, highlightTerms, objectTerms) => {
    const results = performSearch(query, searchTerms, excludedTerms, highlightTerms, objectTerms);
    const d = data();
    if (!d) return results;
    // one entry per page: the best-scored one Sphinx found (a matching section title wins)
    const best = new Map();
    results.forEach((r) => {
      const prev = best.get(r[0]);
      if (!prev || r[4] > prev[4] || (r[4] === prev[4] && r[2] && !prev[2])) best.set(r[0], r);
    });
    const words = [...searchTerms];
    const out = [...best.values()].map((r) => {
      const copy = r.slice();
      copy[4] = rank(d, r[0], words) * 100 + r[4] / 100;
      return copy;
    });
    // ascending: the page pops results from the end
    out.sort((a, b) => a[4] - b[4]);
    return out;
  };
  Search.htmlToText = htmlToText;
  };

  const TEX = {
    alpha: "α", beta: "β", gamma: "γ", delta: "δ", epsilon: "ε", eta: "η", theta: "θ",
    lambda: "λ", mu: "μ", pi: "π", rho: "ρ", sigma: "σ", tau: "τ", phi: "φ", psi: "ψ",
    omega: "ω", Delta: "Δ", Sigma: "Σ", Phi: "Φ", Psi: "Ψ", Omega: "Ω", cdot: "·",
    times: "×", approx: "≈", le: "≤", leq: "≤", ge: "≥", geq: "≥", ne: "≠", neq: "≠",
    to: "→", rightarrow: "→", infty: "∞", sqrt: "√", ldots: "…", dots: "…", cdots: "…",
    pm: "±", sum: "Σ", log: "log", exp: "exp", max: "max", min: "min",
  };
  const texToText = (tex) =>
    tex
      .trim()
      .replace(/^\\\(|\\\)$|^\\\[|\\\]$/g, "")
      .replace(/\\(?:text|mathrm|mathbf|mathit|operatorname|textbf|textit)\s*\{([^{}]*)\}/g, "$1")
      .replace(/\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}/g, "$1/$2")
      .replace(/\\([A-Za-z]+)/g, (m, name) => (name in TEX ? TEX[name] : ""))
      .replace(/\\[,;:! ]/g, " ")
      .replace(/[{}]/g, "")
      .replace(/\s+/g, " ")
      .trim();
  window.courseTexToText = texToText;

  const CHROME = [
    ".headerlink", "script", "style", "div.cell", ".toctree-wrapper", "nav",
    ".bd-header-article", ".header-article-items", ".prev-next-area", ".prev-next-footer",
    "footer", "#searchbox", ".gpu-run-note", "mjx-assistive-mml",
    ".tm-calc", // the calculator's form and answer: its options are not prose
  ].join(", ");
  const htmlToText = (htmlString, anchor) => {
    const doc = new DOMParser().parseFromString(htmlString, "text/html");
    const main = doc.querySelector("article.bd-article") || doc.querySelector('[role="main"]');
    if (!main) return "";
    main.querySelectorAll(CHROME).forEach((el) => el.remove());
    main.querySelectorAll("span.math, div.math").forEach((el) => {
      el.replaceWith(doc.createTextNode(` ${texToText(el.textContent)} `));
    });
    let root = main;
    if (anchor) {
      try {
        root = main.querySelector(anchor) || main;
      } catch (e) {
        root = main;
      }
    }
    return root.textContent.replace(/\s+/g, " ").trim();
  };
  // searchtools.js may load after this file: patch now, or as the page finishes parsing
  // (before Search.init, which the search page runs on DOMContentLoaded)
  if (typeof Search !== "undefined") patch();
  else document.addEventListener("DOMContentLoaded", patch);
})();
