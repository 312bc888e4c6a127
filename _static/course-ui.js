/* Interface strings that scripts write after the page has loaded (sphinx-togglebutton's
 * aria-label on every dropdown button), in Chinese. Attributes in the HTML itself are translated
 * at build time (_ext/course_ui.py). */
window.addEventListener("load", () => {
  document.querySelectorAll('[aria-label="Toggle hidden content"]').forEach((e) => {
    e.setAttribute("aria-label", "展开或收起隐藏的内容");
  });
});

/* Figures on a phone: a figure drawn 774 px wide and shown 358 px wide has ~5 px legend text.
 * A tap (or click) on a figure that the page shows scaled down opens it at its full size in an
 * overlay that scrolls in both directions (pinch-zoom works there too); a tap, Escape or the
 * browser's Back closes it. Figures shown at their natural size are left alone. */
(() => {
  const FIGURES = "article .cell_output img, article figure img";
  const scaledDown = (img) => img.naturalWidth > 0 && img.clientWidth < 0.95 * img.naturalWidth;
  let overlay = null;
  const close = () => {
    if (!overlay) return;
    overlay.remove();
    overlay = null;
    document.documentElement.classList.remove("course-lightbox-open");
  };
  const open = (img) => {
    close();
    overlay = document.createElement("div");
    overlay.className = "course-lightbox";
    overlay.setAttribute("role", "dialog");
    overlay.setAttribute("aria-modal", "true");
    overlay.setAttribute("aria-label", "原尺寸的图（点按任意处关闭）");
    overlay.tabIndex = -1;
    const big = document.createElement("img");
    big.src = img.currentSrc || img.src;
    big.alt = img.alt || "";
    big.width = img.naturalWidth;
    overlay.appendChild(big);
    const hint = overlay.appendChild(document.createElement("p"));
    hint.className = "course-lightbox-hint";
    hint.textContent = "原尺寸显示：可左右拖动；点按任意处关闭";
    overlay.addEventListener("click", close);
    document.body.appendChild(overlay);
    document.documentElement.classList.add("course-lightbox-open");
    overlay.focus();
  };
  const init = () => {
    const mark = () =>
      document.querySelectorAll(FIGURES).forEach((img) => {
        if (img.closest("a")) return; // a linked image keeps its link
        img.classList.toggle("course-zoomable", scaledDown(img));
      });
    mark();
    window.addEventListener("resize", mark);
    window.addEventListener("load", mark);
    document.addEventListener("click", (event) => {
      const img = event.target.closest && event.target.closest(FIGURES);
      if (!img || img.closest("a") || !scaledDown(img)) return;
      event.preventDefault();
      open(img);
    });
    document.addEventListener("keydown", (event) => {
      if (overlay && event.key === "Escape") close();
    });
  };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();

/* Wide outputs (course.css wraps them): a printed table a little wider than the column is shown
 * in a slightly smaller font so that its columns stay aligned; only when it would need less than
 * MIN_PX does it wrap. Tables likewise (fitTables). Measured again after the fonts load and when
 * the window is resized. */
(() => {
  const MIN_PX = 11;
  const fit = () => {
    document.querySelectorAll("article div.cell_output pre").forEach((pre) => {
      pre.style.removeProperty("font-size");
      pre.classList.add("course-fit"); // white-space: pre, to measure the longest line
      const over = pre.scrollWidth - pre.clientWidth;
      if (over <= 1) return; // fits as it is
      const style = getComputedStyle(pre);
      const pad = parseFloat(style.paddingLeft) + parseFloat(style.paddingRight);
      const size = parseFloat(style.fontSize);
      const want = Math.floor(size * ((pre.clientWidth - pad) / (pre.scrollWidth - pad)) * 10) / 10;
      if (want >= MIN_PX) {
        pre.style.fontSize = `${want}px`;
        if (pre.scrollWidth - pre.clientWidth <= 1) return;
        pre.style.removeProperty("font-size");
      }
      // too wide even so. A printout in columns (two or more spaces between fields on at
      // least two lines) keeps its columns and scrolls on a phone; other text wraps, and on
      // a desktop everything wraps (nothing scrolls sideways there).
      if (columns(pre) && window.innerWidth < DESKTOP_PX) return;
      pre.classList.remove("course-fit");
    });
  };
  const DESKTOP_PX = 960;
  const columns = (pre) =>
    pre.textContent.split("\n").filter((l) => /\S {2,}\S/.test(l)).length >= 2;
  // A table wider than the column (a row of long snake_case headers): a smaller font first,
  // then headers and cells may break at spaces and underscores (a zero-width space after each),
  // never inside a number or a word: a token with a hyphen, slash or parenthesis ("ZeRO-2",
  // "bytes/param", "fp16(bits)") is kept on one line. What still does not fit scrolls inside
  // the table's own box.
  const TABLE_STEPS = [0.9, 0.8];
  const TOKEN = /[A-Za-z0-9][A-Za-z0-9.,%+\-\u2212\u00d7\/:()']*[-\u2212\/(][A-Za-z0-9.,%+\-\u2212\u00d7\/:()']*/g;
  const keepTokens = (cell) => {
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    const nodes = [];
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      if (!n.parentElement.closest(".course-nw")) nodes.push(n);
    }
    for (const n of nodes) {
      const text = n.nodeValue;
      TOKEN.lastIndex = 0;
      if (!TOKEN.test(text)) continue;
      TOKEN.lastIndex = 0;
      const frag = document.createDocumentFragment();
      let at = 0;
      for (const m of text.matchAll(TOKEN)) {
        frag.append(text.slice(at, m.index));
        const span = document.createElement("span");
        span.className = "course-nw";
        span.textContent = m[0];
        frag.append(span);
        at = m.index + m[0].length;
      }
      frag.append(text.slice(at));
      n.replaceWith(frag);
    }
  };
  const fitTables = () => {
    document.querySelectorAll("article table").forEach((table) => {
      if (!table.dataset.courseTokens) {
        table.dataset.courseTokens = "1";
        table.querySelectorAll("th, td").forEach(keepTokens);
      }
      const box = table.closest(".pst-scrollable-table-container") || table;
      const over = () => box.scrollWidth - box.clientWidth > 1 || table.scrollWidth - table.clientWidth > 1;
      if (!table.dataset.courseFit) {
        if (!over()) return;
        table.dataset.courseFit = "1";
      }
      table.style.removeProperty("font-size");
      table.classList.remove("course-table-wrap");
      for (const step of TABLE_STEPS) {
        if (!over()) return;
        table.style.fontSize = `${step}em`;
      }
      if (!over()) return;
      table.classList.add("course-table-wrap");
      table.querySelectorAll("th, td").forEach((cell) => {
        const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
        for (let n = walker.nextNode(); n; n = walker.nextNode()) {
          if (n.nodeValue.includes("_") && !n.nodeValue.includes("_\u200b")) {
            n.nodeValue = n.nodeValue.replace(/_/g, "_\u200b");
          }
        }
      });
    });
  };
  // A display equation a little wider than the column (a phone) is typeset a little smaller
  // (MathJax's CHTML output scales with the font size), down to MATH_MIN of its size; a wider
  // one keeps its size and scrolls inside its own box.
  const MATH_MIN = 0.8;
  const fitMath = () => {
    document.querySelectorAll('article mjx-container[display="true"]').forEach((m) => {
      m.style.removeProperty("font-size");
      const over = m.scrollWidth - m.clientWidth;
      if (over <= 1 || !m.clientWidth) return;
      const want = Math.floor((m.clientWidth / m.scrollWidth) * 100) / 100;
      if (want < MATH_MIN) return;
      m.style.fontSize = `${want * 100}%`;
      if (m.scrollWidth - m.clientWidth > 1) m.style.removeProperty("font-size");
    });
  };
  const fitAll = () => {
    fit();
    fitTables();
    fitMath();
  };
  const init = () => {
    fitAll();
    if (document.fonts && document.fonts.ready) document.fonts.ready.then(fitAll);
    window.addEventListener("load", fitAll);
    // again whenever the text column changes width (window resized, sidebar collapsed, a
    // scrollbar appearing once MathJax has typeset the page)
    let t = null;
    const later = () => {
      window.clearTimeout(t);
      t = window.setTimeout(fitAll, 50);
    };
    window.addEventListener("resize", later);
    const article = document.querySelector("article");
    if (article && window.ResizeObserver) {
      let width = article.clientWidth;
      new ResizeObserver(() => {
        if (article.clientWidth !== width) {
          width = article.clientWidth;
          later();
        }
      }).observe(article);
    }
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
      MathJax.startup.promise.then(later);
    }
  };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
