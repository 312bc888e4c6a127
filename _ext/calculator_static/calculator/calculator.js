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
  // the replay's phases (trainmem.memory), in Chinese with the name the CLI prints
  const PHASES = {
    pre: "准备", forward: "前向", backward: "反向", optimizer: "优化器更新", idle: "步间",
    generate: "生成", validate: "验证",
  };
  const phaseName = (p) => (PHASES[p] ? `${PHASES[p]}（${p}）` : p);
  // why the CLI refused an input, in Chinese (its own one-line message is quoted below it)
  const REASONS = [
    [/must be an integer ≥ (\d+), got (.*)$/, (m) => `须为不小于 ${m[1]} 的整数，填的是 ${m[2]}`],
    [/must be a number in \[0, 1\), got (.*)$/, (m) => `须为 0 到 1 之间（不含 1）的数，填的是 ${m[1]}`],
    [/must be ≥ 1 and ≤ [^=]*=(\d+), got (.*)$/, (m) => `须在 1 到 ${m[1]} 之间，填的是 ${m[2]}`],
    [/unknown target module '([^']*)'; allowed: (.*)$/, (m) => `没有名为 ${m[1]} 的模块，可选：${m[2]}`],
    [/unknown library '([^']*)'; allowed: (.*)$/, (m) => `不认识的库 ${m[1]}，可选：${m[2]}`],
    [/is not valid JSON/, () => "粘贴的 config.json 不是合法的 JSON"],
    [/model_type must be one of ([^,]+(?:, [^,]+)*), got (.*)$/,
      (m) => `model_type 只支持 ${m[1]}，填的是 ${m[2]}`],
    [/must be one of|invalid choice/, () => "不是可选的取值"],
    [/must be|got/, () => "取值不在允许的范围内"],
  ];
  function reason(msg) {
    const text = msg.replace(/^.*?error:\s*/, "");
    for (const [re, say] of REASONS) {
      const m = re.exec(text);
      if (m) return say(m);
    }
    return "命令行拒绝了这个取值";
  }
  // a change trainmem fit proposes (its options), in Chinese
  function changeText(o) {
    const parts = [];
    if (o.batch !== undefined) {
      parts.push(`微批改为 ${o.batch}` + (o.grad_accum !== undefined
        ? `、梯度累积 ${o.grad_accum} 步（全局 batch 不变）` : ""));
    }
    if (o.optimizer === "adamw8bit") parts.push("改用 8 位 AdamW（adamw8bit）");
    else if (o.optimizer !== undefined) parts.push(`优化器改为 ${o.optimizer}`);
    if (o.checkpointing) parts.push("打开激活检查点（activation checkpointing）");
    if (o.method === "qlora") parts.push("改用 QLoRA（4 位 NF4 基座）");
    else if (o.method !== undefined) parts.push(`方法改为 ${o.method}`);
    return parts.join("，再");
  }
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
        return f"这不是一个数：{text!r}（可以试 0.1、65504、1e-8）"
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
    // the answer is below a long form on a phone: a pointer above the form says the peak and
    // jumps to the answer (course CSS keeps it in view while the form scrolls by)
    result.id = result.id || `${root.id}-result`;
    result.tabIndex = -1;
    const jump = el("a", { class: "tm-calc-jump", href: `#${result.id}` }, "结果在表单下方 ↓");
    jump.addEventListener("click", (event) => {
      event.preventDefault();
      result.scrollIntoView({ block: "start" });
      result.focus({ preventScroll: true });
    });
    form.before(jump);
    let timer = null, answered = false, seq = 0;

    function argv(command = "estimate") {
      const out = [command];
      let config = null;
      for (const f of fields) {
        const flag = f.dataset.flag;
        if (f.dataset.kind === "flag") {
          if (f.checked) out.push(flag);
        } else if (f.value === "" && (f.dataset.kind === "choice" || f.defaultValue === "")) {
          // "默认", or an optional number left empty: the option is not passed, as on
          // the command line
        } else {
          out.push(`${flag}=${f.value}`);
          if (f.dataset.kind === "model" && f.value === "config.json") {
            config = form.elements["config-json"].value;
          }
        }
      }
      if (command === "estimate") out.push("--timeline");  // the step's memory timeline
      out.push("--json");
      return { argv: out, config };
    }

    // the field a CLI error names (--seq, argument --lora-rank: ...), marked on the form
    function markBad(msg) {
      for (const f of fields) { f.classList.remove("tm-bad"); f.removeAttribute("aria-invalid"); }
      const m = /(--[a-z0-9-]+)/.exec(msg || "");
      if (!m) return null;
      const f = fields.find((x) => x.dataset.flag === m[1]);
      if (!f) return null;
      f.classList.add("tm-bad");
      f.setAttribute("aria-invalid", "true");
      const label = form.querySelector(`label[for="${f.id}"]`);
      return label ? label.textContent.trim() : m[1];
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
        el("strong", { class: "tm-calc-phase", "data-phase": phase }, phaseName(phase)),
        " 阶段。");
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

    // trainmem.estimate.recipe's words in Chinese (its dtype names stay as they are)
    function zhRecipe(r) {
      return r
        .replace(/^NF4 base \((\w+) non-quantized weights\)/, "NF4 底座（未量化的权重为 $1）")
        .replace(/module cast to (\w+), fp32 master copy/, "整个模块转为 $1，另有 fp32 主副本")
        .replace(/no autocast/, "不用自动混合精度")
        .replace(/autocast (\w+)/, "自动混合精度（autocast）$1")
        .replace(/(\w+) base/, "$1 底座").replace(/(\w+) adapters/, "$1 适配器")
        .replace(/(\w+) weights/, "$1 权重").replace(", ", "，");
    }

    function notes(d) {
      const phases = Object.entries(d.phase_peaks)
        .map(([k, v]) => `${phaseName(k)} ${fmt(v, GiB)} GiB`).join("；");
      const n = (x) => x.toLocaleString("en-US");
      const out = [`各阶段峰值：${phases}。`,
        `参数 ${n(d.n_params)} 个，其中可训练 ${n(d.n_trainable)} 个。`];
      // the recipe the estimate replayed (trainmem.estimate.recipe): which dtype the
      // weights are held in and what casts them
      if (d.options && d.options.recipe) out.push(`配方（recipe）：${zhRecipe(d.options.recipe)}。`);
      if (!d.exact) out.push("该模型用闭式公式估计激活（未逐算子回放）。");
      // the SDPA kernel torch selects for this step (trainmem.sdpa)
      const sdpa = { flash: "flash", efficient: "memory-efficient", cudnn: "cuDNN",
        math: "数学路径（math）" };
      const backend = d.attention && d.attention.sdpa_backend;
      if (backend) out.push(`注意力：SDPA 运行 ${sdpa[backend] || backend} 后端。`);
      // a family with no SDPA path in transformers (Gemma 2) runs its own attention
      if (d.attention && d.attention.kind === "eager" && d.attention.reason)
        out.push("注意力：这个模型族在 transformers 里没有 SDPA 路径，按 eager 注意力重放"
          + "（分数与 softmax 整块存下）。");
      return el("p", { class: "tm-calc-notes" }, out.join(" "));
    }

    // the estimator's notes about the card (trainmem.estimate._gpu_notes), by code
    const GPU_NOTES = {
      "bf16-emulated": (g) => `${g} 没有 bf16 运算单元：PyTorch 在它上面模拟 bf16，训练很慢；`
        + "这张卡上该选 fp16-amp。",
      "sdpa-math": (g) => `在 ${g} 上，SDPA 的融合内核（fused kernel：flash、cuDNN、memory-efficient）都不接这次调用`
        + "（例如计算能力 8.0 以下的 bf16，或 fp32 加 GQA），注意力退回数学路径"
        + "（分数与 softmax 整块存下）；上面的数字按这条路径重放。",
      "sdpa-math-not-modelled": (g) => `在 ${g} 上，SDPA 的融合内核（fused kernel）都不接这次调用，`
        + "注意力退回数学路径（分数与 softmax 整块存下）；这个估算没有计入它。",
      "deepspeed-checkpoint-error": () => "DeepSpeed ZeRO-3 下 LoRA 配非重入检查点：没有合入 "
        + "deepspeedai/DeepSpeed#8148 的 DeepSpeed 版本会在反向里报 torch 的 CheckpointError"
        + "（0.16.4 上复现过）；改用 gradient_checkpointing_kwargs={'use_reentrant': True}"
        + "（检查点形式选 reentrant）可以跑。",
      "nvls-not-modelled": () => "NCCL 的 NVLS（NVLink SHARP）缓冲区不在这个估算里：NVSwitch 连接的"
        + "计算能力 9.0 及以上的 GPU 超过 2 张时，NCCL 为每个通信器在每张卡上映射这块内存，"
        + "随 NCCL 版本可达每卡数 GiB；设 NCCL_NVLS_ENABLE=0 可关掉。",
    };

    // what the GPU reports: allocated, reserved (caching allocator), nvidia-smi, fits
    function gpuBlock(d) {
      if (!d.gpu) {
        return el("p", { class: "tm-calc-notes" },
          "选择“GPU 型号”可看到缓存分配器保留的显存（reserved）、nvidia-smi 显示的显存与是否放得下。");
      }
      const tbody = el("tbody");
      tbody.append(bytesRow(el("th", { scope: "row" }, "张量峰值（max_memory_allocated）"),
        d.gpu_allocated_bytes));
      tbody.append(bytesRow(el("th", { scope: "row" }, "保留（max_memory_reserved）"),
        d.reserved_bytes));
      tbody.append(bytesRow(el("th", { scope: "row" }, "+ CUDA 上下文"), d.context_bytes));
      if (d.nccl_bytes) {
        const label = `+ NCCL 缓冲区（${d.nccl_communicators} 个通信器 × ${d.nccl_channels} 个通道）`;
        tbody.append(bytesRow(el("th", { scope: "row" }, label), d.nccl_bytes));
      }
      tbody.append(bytesRow(el("th", { scope: "row" }, "nvidia-smi（下限）"),
        d.device_bytes));
      tbody.append(bytesRow(el("th", { scope: "row" }, `${d.gpu} 显存`), d.capacity_bytes));
      const verdict = d.fits
        ? `放得下，余量 ${fmt(d.headroom_bytes, GiB, 2)} GiB。`
        : `放不下：还差 ${fmt(-d.headroom_bytes, GiB, 2)} GiB（或分配器回放在显存上限处失败）。`;
      const notes = (d.notes || []).map((n) => el("p",
        { class: "tm-calc-gpu-note", "data-code": n.code },
        GPU_NOTES[n.code] ? GPU_NOTES[n.code](d.gpu) : n.message));
      return el("div", { class: "tm-calc-gpu", "data-fits": String(d.fits) },
        el("p", { class: "tm-calc-verdict" }, el("strong", {}, `${d.gpu}：`), verdict),
        ...notes,
        el("div", { class: "tm-table-wrap" }, el("table", { class: "tm-table tm-gpu-table" },
          el("thead", {}, el("tr", {}, ...["", "GB", "GiB", "字节"].map((t) => el("th", {}, t)))),
          tbody)));
    }

    // the step's memory timeline: bytes by category over the replayed allocations
    function timelineChart(points) {
      const NS = "http://www.w3.org/2000/svg";
      const svg = document.createElementNS(NS, "svg");
      const W = 640, H = 180;
      svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
      svg.setAttribute("class", "tm-timeline");
      svg.setAttribute("role", "img");
      const totals = points.map((p) => TERMS.reduce((a, [k]) => a + (p[k] || 0), 0));
      const top = Math.max(...totals, ...points.map((p) => p.reserved || 0)) || 1;
      const x = (i) => (W * i) / Math.max(1, points.length - 1);
      const y = (v) => H - (H * v) / top;
      svg.setAttribute("aria-label", `显存时间线：最高 ${fmt(Math.max(...totals), GiB)} GiB`);
      let lower = points.map(() => 0);
      for (const [k] of TERMS) {
        const upper = points.map((p, i) => lower[i] + (p[k] || 0));
        const pts = upper.map((v, i) => `${x(i)},${y(v)}`)
          .concat(lower.map((v, i) => `${x(i)},${y(v)}`).reverse());
        const poly = document.createElementNS(NS, "polygon");
        poly.setAttribute("points", pts.join(" "));
        poly.setAttribute("class", `tm-area tm-${k}`);
        svg.append(poly);
        lower = upper;
      }
      if (points[0] && points[0].reserved !== undefined) {
        const line = document.createElementNS(NS, "polyline");
        line.setAttribute("points", points.map((p, i) => `${x(i)},${y(p.reserved)}`).join(" "));
        line.setAttribute("class", "tm-reserved-line");
        svg.append(line);
      }
      let last = null;
      points.forEach((p, i) => {        // phase boundaries
        if (last !== null && p.phase !== last) {
          const t = document.createElementNS(NS, "text");
          t.setAttribute("x", String(x(i) + 2));
          t.setAttribute("y", "12");
          t.setAttribute("class", "tm-phase-label");
          t.textContent = PHASES[p.phase] || p.phase;
          svg.append(t);
        }
        last = p.phase;
      });
      return el("figure", { class: "tm-calc-timeline" }, svg,
        el("figcaption", {}, "训练步的显存时间线（由回放预测）：横轴是分配事件的顺序，纵轴是存活字节，"
          + "按类别堆叠；前向上升、反向下降、优化器更新处的尖峰。虚线是缓存分配器保留的显存（选择 GPU 时）。"));
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
        const bad = markBad(msg);
        result.dataset.badField = bad || "";
        result.append(el("p", { class: "tm-calc-error", role: "alert" },
          bad ? `输入有误：“${bad}”这一项不合法（已在表单中标红）：${reason(msg)}。`
            : `输入有误：${reason(msg)}。`,
          el("br"), "命令行的原话（英文）：", el("code", {}, msg)));
        jump.textContent = "输入有误：跳到说明 ↓";
        status.textContent = "输入有误，请修改标红的选项；修改后自动重新计算。";
        return;
      }
      markBad(null);
      delete result.dataset.badField;
      delete result.dataset.error;
      const m = /"total_bytes":\s*(\d+)/.exec(res.stdout);  // exact digits, no float round trip
      const d = JSON.parse(res.stdout);
      const total = d.total_bytes;
      result.dataset.totalBytes = m ? m[1] : String(total);
      jump.textContent = `峰值 ${fmt(total, GiB, 2)} GiB`
        + (d.gpu ? `，${d.gpu}${d.fits ? "放得下" : "放不下"}` : "") + "：看结果 ↓";
      result.append(headline(total, d.peak_phase), ...barAndLegend(d.breakdown, total),
        bytesTable(d.breakdown, total), gpuBlock(d), notes(d));
      if (d.timeline && d.timeline.length) result.append(timelineChart(d.timeline));
      result.append(fitBox);
    }

    // trainmem fit: the largest micro-batch on the chosen GPU, the cheapest change
    const fitBox = el("div", { class: "tm-calc-fit" });
    const fitButton = el("button", { type: "button", class: "tm-fit-button" },
      "求这张 GPU 上最大的微批（python -m trainmem fit）");
    const fitOut = el("p", { class: "tm-fit-out", "aria-live": "polite" });
    fitBox.append(fitButton, fitOut);
    fitButton.addEventListener("click", async () => {
      const gpu = form.elements["gpu"];
      if (!gpu || gpu.value === "") {
        fitOut.textContent = "请先在“GPU 型号”里选一张卡。";
        return;
      }
      fitOut.textContent = "正在搜索（每一步都回放一次训练步）…";
      const run = await runtimeOrSay(root, status);
      if (!run) return;
      const args = argv("fit");
      const res = run.estimate(args.argv, args.config);
      fitOut.dataset.argv = JSON.stringify(args.argv);
      if (res.rc !== 0) {
        const msg = res.stderr.trim().split("\n").pop();
        const bad = markBad(msg);
        fitOut.replaceChildren(`输入有误${bad ? `（“${bad}”）` : ""}：${reason(msg)}。命令行的原话（英文）：`,
          el("code", {}, msg));
        return;
      }
      const r = JSON.parse(res.stdout);
      fitOut.dataset.maxBatch = String(r.max_batch);
      const parts = [r.max_batch > 0
        ? `${r.gpu} 上最大微批 ${r.max_batch}（nvidia-smi 约 ${fmt(r.device_bytes, GiB, 2)} GiB）。`
        : `${r.gpu} 上连微批 1 也放不下。`];
      const c = r.cheapest_change;
      if (c) {
        parts.push(c.change ? `当前设置放不下；最省事的改法：${changeText(c.options || {})}`
          + `（约 ${fmt(c.device_bytes, GiB, 2)} GiB）。` : "试过的改法都放不下。");
      } else {
        parts.push("当前设置放得下。");
      }
      fitOut.textContent = parts.join(" ");
    });

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
      if (res.rc !== 0) return;   // render() has put the error (in Chinese) in the status
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
