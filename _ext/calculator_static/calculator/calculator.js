// The in-page memory calculator: `python -m trainmem estimate ... --json` run by Pyodide.
// The form is rendered at build time from the CLI's argparse options (_ext/calculator.py); this
// script loads Pyodide and the estimator modules from the built site (no CDN, no network beyond
// the site itself), turns the form into the CLI's argv and calls trainmem.cli.main(argv).
(function () {
  "use strict";
  const here = new URL("./", document.currentScript.src);
  const LIB = "/home/pyodide/trainmem-lib";
  const WORK = "/home/pyodide/trainmem-work";
  const TERMS = [
    ["weights", "权重"], ["gradients", "梯度"], ["optimizer_states", "优化器状态"],
    ["master_weights", "主权重"], ["activations", "激活"], ["temporaries", "临时张量"],
  ];
  const GiB = 2 ** 30, GB = 1e9;
  const RUNNER = `
import contextlib, io, json, os, sys
sys.path.insert(0, ${JSON.stringify(LIB)})
os.makedirs(${JSON.stringify(WORK)}, exist_ok=True)
os.chdir(${JSON.stringify(WORK)})
from trainmem.cli import main as _tm_main

def tm_run(request):
    """Run the CLI exactly as the shell would; return its exit status, stdout and stderr.
    request: JSON {"argv": [...], "config": text of config.json or null}."""
    request = json.loads(request)
    argv, config_text = request["argv"], request["config"]
    if config_text is not None:
        with open("config.json", "w", encoding="utf-8") as f:
            f.write(config_text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = _tm_main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception as e:  # a bug, not bad input: show it instead of a stale result
            print(f"internal error: {type(e).__name__}: {e}", file=sys.stderr)
            rc = 1
    return json.dumps({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})

def tm_formats(text):
    """Chapter 1's explorer: what the ipywidgets demo (coursekit.widgets) shows for the text."""
    from trainmem.formats import describe_value
    try:
        return describe_value(float(text))
    except ValueError:
        return f"not a number: {text!r} (try 0.1, 65504, 1e-8)"
`;

  let runtime = null;
  const timings = {};   // ms since navigation start, shown on the root element (data-timings)
  const mark = (k) => { timings[k] = Math.round(performance.now()); };
  function loadRuntime() {
    if (runtime) return runtime;
    runtime = (async () => {
      mark("start");
      const manifestP = fetch(new URL("manifest.json", here)).then((r) => {
        if (!r.ok) throw new Error(`manifest.json: HTTP ${r.status}`);
        return r.json();
      });
      const { loadPyodide } = await import(new URL("pyodide/pyodide.mjs", here).href);
      mark("imported");
      const pyP = loadPyodide({ indexURL: new URL("pyodide/", here).href });
      const manifest = await manifestP;
      const texts = await Promise.all(manifest.files.map((f) =>
        fetch(new URL("py/" + f, here)).then((r) => {
          if (!r.ok) throw new Error(`${f}: HTTP ${r.status}`);
          return r.text();
        })));
      const py = await pyP;
      mark("pyodide");
      manifest.files.forEach((f, i) => {
        const path = `${LIB}/${f}`;
        py.FS.mkdirTree(path.slice(0, path.lastIndexOf("/")));
        py.FS.writeFile(path, texts[i]);
      });
      py.runPython(RUNNER);
      mark("estimator");
      const run = py.globals.get("tm_run");
      const formats = py.globals.get("tm_formats");
      return {
        estimate: (argv, config) => JSON.parse(run(JSON.stringify({ argv, config }))),
        formats: (text) => formats(text),
      };
    })();
    return runtime;
  }

  // the runtime, or null after telling the reader why it did not load
  async function runtimeOrSay(root, status) {
    try {
      return await loadRuntime();
    } catch (e) {
      status.textContent = `无法加载 Pyodide：${e.message}（请通过 HTTP 打开本书，而不是 file://）`;
      root.dataset.state = "failed";
      return null;
    }
  }

  function fmt(bytes, unit, digits = 3) {
    return (bytes / unit).toLocaleString("en-US", {
      minimumFractionDigits: digits, maximumFractionDigits: digits });
  }

  function el(tag, attrs = {}, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c);
    return e;
  }

  function setup(root) {
    const form = root.querySelector("form");
    const status = root.querySelector(".tm-calc-status");
    const result = root.querySelector(".tm-calc-result");
    const configBox = root.querySelector(".tm-calc-config");
    const fields = [...form.querySelectorAll("[data-flag]")];
    let timer = null, answered = false, seq = 0;

    function argv() {
      const out = ["estimate"];
      let config = null;
      for (const f of fields) {
        const flag = f.dataset.flag;
        if (f.dataset.kind === "flag") {
          if (f.checked) out.push(flag);
        } else if (f.dataset.kind === "choice" && f.value === "") {
          // "默认": the option is not passed, as on the command line
        } else {
          out.push(`${flag}=${f.value}`);
          if (f.dataset.kind === "model" && f.value === "config.json") {
            config = form.elements["config-json"].value;
          }
        }
      }
      out.push("--json");
      return { argv: out, config };
    }

    function showRelevant() {
      const method = form.elements["method"] ? form.elements["method"].value : "";
      for (const box of form.querySelectorAll("[data-when]")) {
        box.hidden = !box.dataset.when.split(" ").includes(method);
      }
      const model = form.elements["model"];
      configBox.hidden = !(model && model.value === "config.json");
    }

    // one table row: a header cell, then the bytes in GB, GiB and exact bytes
    function bytesRow(head, bytes, attrs = {}) {
      return el("tr", attrs, head, el("td", {}, fmt(bytes, GB)),
        el("td", {}, fmt(bytes, GiB)), el("td", {}, bytes.toLocaleString("en-US")));
    }

    function headline(total, phase) {
      return el("p", { class: "tm-calc-headline" },
        "每张 GPU 的峰值显存：", el("strong", {}, `${fmt(total, GiB)} GiB`),
        `（${fmt(total, GB)} GB，${total.toLocaleString("en-US")} 字节），峰值出现在 `,
        el("strong", { class: "tm-calc-phase" }, phase), " 阶段。");
    }

    function barAndLegend(breakdown, total) {
      const label = TERMS.map(([k, zh]) => `${zh} ${fmt(breakdown[k], GiB)} GiB`);
      const bar = el("div", { class: "tm-bar", role: "img", "aria-label": label.join("，") });
      const legend = el("ul", { class: "tm-legend" });
      for (const [k, zh] of TERMS) {
        const v = breakdown[k];
        if (v > 0) {
          bar.append(el("span", { class: `tm-seg tm-${k}`, style: `width:${(100 * v) / total}%`,
            title: `${zh}（${k}）${fmt(v, GiB)} GiB` }));
        }
        legend.append(el("li", {}, el("span", { class: `tm-swatch tm-${k}` }), `${zh}（${k}）`));
      }
      return [bar, legend];
    }

    function bytesTable(breakdown, total) {
      const tbody = el("tbody");
      for (const [k, zh] of TERMS) {
        const head = el("th", { scope: "row" }, el("span", { class: `tm-swatch tm-${k}` }),
          zh, el("span", { class: "tm-en" }, `（${k}）`));
        tbody.append(bytesRow(head, breakdown[k]));
      }
      tbody.append(bytesRow(el("th", { scope: "row" }, "合计（峰值）"), total,
        { class: "tm-total" }));
      const thead = el("thead", {}, el("tr", {}, ...["项", "GB", "GiB", "字节"].map(
        (t) => el("th", {}, t))));
      return el("div", { class: "tm-table-wrap" }, el("table", { class: "tm-table" }, thead, tbody));
    }

    function notes(d) {
      const phases = Object.entries(d.phase_peaks)
        .map(([k, v]) => `${k} ${fmt(v, GiB)} GiB`).join("；");
      const n = (x) => x.toLocaleString("en-US");
      const out = [`各阶段峰值：${phases}。`,
        `参数 ${n(d.n_params)} 个，其中可训练 ${n(d.n_trainable)} 个。`];
      if (!d.exact) out.push("该模型用闭式公式估计激活（未逐算子回放）。");
      return el("p", { class: "tm-calc-notes" }, out.join(" "));
    }

    function render(res, args, ms) {
      result.replaceChildren();
      result.dataset.seq = String(++seq);             // tests wait for the answer to a change
      result.dataset.argv = JSON.stringify(args.argv);
      result.dataset.ms = ms.toFixed(1);
      if (res.rc !== 0) {
        const msg = (res.stderr.trim().split("\n").pop() || `exit status ${res.rc}`);
        delete result.dataset.totalBytes;
        result.dataset.error = msg;
        result.append(el("p", { class: "tm-calc-error", role: "alert" }, msg));
        return;
      }
      delete result.dataset.error;
      const m = /"total_bytes":\s*(\d+)/.exec(res.stdout);  // exact digits, no float round trip
      const d = JSON.parse(res.stdout);
      const total = d.total_bytes;
      result.dataset.totalBytes = m ? m[1] : String(total);
      result.append(headline(total, d.peak_phase), ...barAndLegend(d.breakdown, total),
        bytesTable(d.breakdown, total), notes(d));
    }

    async function compute() {
      const args = argv();
      if (!answered) status.textContent = "正在加载浏览器内的 Python（Pyodide）与估算器模块…";
      const run = await runtimeOrSay(root, status);
      if (!run) return;
      const t0 = performance.now();
      const res = run.estimate(args.argv, args.config);
      const ms = performance.now() - t0;
      render(res, args, ms);
      if (!answered) {          // time since the page started loading (navigation start)
        answered = true;
        root.dataset.firstAnswerMs = performance.now().toFixed(0);
        mark("answer");
        root.dataset.timings = JSON.stringify(timings);
      }
      root.dataset.state = "ready";
      status.textContent = `就绪（浏览器内 Python，首次结果用时 ${(root.dataset.firstAnswerMs / 1000).toFixed(1)} s；`
        + `本次计算 ${ms.toFixed(0)} ms）。修改任一选项即重新计算，结果与 python -m trainmem estimate 相同。`;
    }

    function schedule() {
      showRelevant();
      clearTimeout(timer);
      timer = setTimeout(compute, 120);
    }

    form.addEventListener("input", schedule);
    form.addEventListener("change", schedule);
    showRelevant();
    root.dataset.state = "loading";
    status.textContent = "正在加载浏览器内的 Python（Pyodide）与估算器模块…";
    if (root.dataset.load === "visible") {
      status.textContent = "计算器滚动到屏幕上时开始加载浏览器内的 Python（Pyodide）。";
    }
    whenVisible(root, compute);
  }

  function whenVisible(root, start) {
    if (root.dataset.load === "visible" && "IntersectionObserver" in window) {
      const io = new IntersectionObserver((entries) => {
        if (entries.some((e) => e.isIntersecting)) { io.disconnect(); start(); }
      }, { rootMargin: "200px" });
      io.observe(root);
    } else {
      start();
    }
  }

  // chapter 1: the number-format explorer (trainmem.formats.describe_value)
  function setupFormats(root) {
    const input = root.querySelector("input[name=x]");
    const out = root.querySelector(".tm-fmt-out");
    const status = root.querySelector(".tm-calc-status");
    let timer = null, seq = 0;
    async function show() {
      const rt = await runtimeOrSay(root, status);
      if (!rt) return;
      out.textContent = rt.formats(input.value);
      out.dataset.value = input.value;
      out.dataset.seq = String(++seq);
      root.dataset.state = "ready";
      status.textContent = "输入任意数（如 65504、1e-8、0.5001），表格在浏览器里由 trainmem.formats 现场算出。";
    }
    input.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(show, 120); });
    root.dataset.state = "loading";
    status.textContent = "滚动到此处时开始加载浏览器内的 Python（Pyodide）。";
    whenVisible(root, () => {
      status.textContent = "正在加载浏览器内的 Python（Pyodide）…";
      show();
    });
  }

  function init() {
    document.querySelectorAll(".tm-calc").forEach((root) =>
      (root.classList.contains("tm-fmt") ? setupFormats : setup)(root));
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
