/* Menu buttons of the article header (☰ chapter list, ≡ page contents) on phones and desktops.
 *
 * pydata-sphinx-theme 0.17 adds its own sidebar toggles to the top navbar (#pst-header) and binds
 * its handlers with document.querySelector(".primary-toggle") / (".secondary-toggle"): only the
 * FIRST such button, the navbar's, gets a listener (pydata/pydata-sphinx-theme#2451). The
 * sphinx-book-theme 1.3 desktop "collapse the sidebar" handler does the same. The buttons a reader
 * actually sees are the ones in the article header (.bd-header-article), so they did nothing.
 *
 * Fix: a click on a visible toggle is passed on to the navbar's button of the same kind, which
 * carries both themes' handlers: on a wide screen the chapter list collapses/expands, on a narrow
 * one the sidebar opens as a dialog. The navbar itself is hidden (course.css: one search box).
 */
(() => {
  const forward = (kind) => {
    const target = document.querySelector(`#pst-header .${kind}`);
    if (!target) return;
    document.querySelectorAll(`.${kind}`).forEach((button) => {
      if (button === target || button.dataset.courseNav) return;
      button.dataset.courseNav = "1";
      button.addEventListener("click", (event) => {
        event.preventDefault();
        event.stopPropagation();
        target.click();
      });
    });
  };
  const init = () => ["primary-toggle", "secondary-toggle"].forEach(forward);
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
