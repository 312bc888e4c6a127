/* Interface strings that scripts write after the page has loaded (sphinx-togglebutton's
 * aria-label on every dropdown button), in Chinese. Attributes in the HTML itself are translated
 * at build time (_ext/course_ui.py). */
window.addEventListener("load", () => {
  document.querySelectorAll('[aria-label="Toggle hidden content"]').forEach((e) => {
    e.setAttribute("aria-label", "展开或收起隐藏的内容");
  });
});
