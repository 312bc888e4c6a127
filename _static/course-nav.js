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
 * A tap on a link in that dialog closes it (see closeOnTap).
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
  /* The phone's drawers (the theme's <dialog>s) stay open after a tap on one of their links.
   * A link to a section of this page closes the drawer first and then goes to the section
   * (closing moves the list back into the sidebar and returns focus to the button, so the
   * jump must come after it); a link to another page closes the drawer as it leaves. */
  const closeOnTap = () => {
    ["pst-primary-sidebar-modal", "pst-secondary-sidebar-modal"].forEach((id) => {
      const dialog = document.getElementById(id);
      if (!dialog || dialog.dataset.courseNav) return;
      dialog.dataset.courseNav = "1";
      dialog.addEventListener("click", (event) => {
        const link = event.target.closest && event.target.closest("a[href]");
        if (!link || !dialog.open) return;
        const url = new URL(link.href, window.location.href);
        const samePage = url.origin === window.location.origin &&
          url.pathname === window.location.pathname;
        if (!samePage) {
          dialog.close();
          return;
        }
        event.preventDefault();
        dialog.close();
        window.setTimeout(() => {
          if (url.hash && url.hash !== window.location.hash) window.location.hash = url.hash;
          const target = url.hash && document.getElementById(decodeURIComponent(url.hash.slice(1)));
          if (target) target.scrollIntoView();
        }, 0);
      });
    });
  };
  const init = () => {
    ["primary-toggle", "secondary-toggle"].forEach(forward);
    closeOnTap();
  };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
