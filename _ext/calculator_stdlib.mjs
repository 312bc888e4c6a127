// Build step of the in-page calculator (_ext/calculator.py runs it with Node.js):
// Pyodide's python_stdlib.zip holds only .py sources, so every page load compiled each standard
// module the interpreter and the estimator import (asyncio, inspect, typing, argparse, ...) —
// about half of the time to the first answer. This script starts the same Pyodide under Node,
// runs the estimator's CLI the way the page does, and writes a copy of the zip that adds a
// bytecode file (unchecked hash-based .pyc, PEP 552) next to each standard module that was
// imported. The bytecode comes from this very interpreter, so it matches the browser's exactly;
// the sources stay in the zip (tracebacks, inspect).
//
//   node calculator_stdlib.mjs <pyodide dir> <dir with trainmem/> <out.zip> <argv JSON list>...
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const [pyodideDir, libDir, outZip, ...argvs] = process.argv.slice(2);
const { loadPyodide } = await import(pathToFileURL(path.join(pyodideDir, "pyodide.mjs")).href);
const py = await loadPyodide({ indexURL: pyodideDir + "/" });

function copyTree(src, dst) {
  py.FS.mkdirTree(dst);
  for (const name of fs.readdirSync(src)) {
    const s = path.join(src, name);
    if (fs.statSync(s).isDirectory()) copyTree(s, `${dst}/${name}`);
    else py.FS.writeFile(`${dst}/${name}`, fs.readFileSync(s));
  }
}
copyTree(libDir, "/home/pyodide/trainmem-lib");
py.globals.set("argvs", JSON.stringify(argvs.map((a) => JSON.parse(a))));
const report = py.runPython(`
import contextlib, io, json, os, sys      # what the page's runner imports
sys.path.insert(0, "/home/pyodide/trainmem-lib")
from trainmem.cli import main
for argv in json.loads(argvs):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
from trainmem.formats import describe_value   # chapter 1's explorer
describe_value(0.1)
ZIP = next(p for p in sys.path if p.endswith(".zip"))
prefix = ZIP + "/"
used = {m.__file__[len(prefix):] for m in list(sys.modules.values())
        if (getattr(m, "__file__", None) or "").startswith(prefix)}
import importlib.util, zipfile           # noqa: E402  (after the modules in use are listed)
import importlib._bootstrap_external as _be
src = zipfile.ZipFile(ZIP)
with zipfile.ZipFile("/tmp/stdlib.zip", "w", zipfile.ZIP_DEFLATED) as out:
    for info in src.infolist():
        data = src.read(info)
        out.writestr(info, data)
        if info.filename in used:
            code = compile(data, prefix + info.filename, "exec", dont_inherit=True)
            pyc = _be._code_to_hash_pyc(code, importlib.util.source_hash(data), checked=False)
            out.writestr(info.filename[:-3] + ".pyc", pyc)
json.dumps({"compiled": len(used), "files": len(src.infolist()), "python": sys.version.split()[0]})
`);
fs.writeFileSync(outZip, py.FS.readFile("/tmp/stdlib.zip"));
console.log(report);
