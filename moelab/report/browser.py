"""Check a report in a real browser: headless Chromium renders it and says whether every figure drew.

>>> result = check_in_browser("report.html", screenshot="out/demo-screenshot.png")
>>> result.problems          # [] when every figure drew and nothing logged an error

A copy of the report gets a small script in its ``<head>`` that records JavaScript errors,
rejected promises and ``console.error`` calls, then, once the page has loaded and plotly has
drawn, writes a JSON verdict into the DOM: per figure div whether plotly drew it (a
``.main-svg`` holding drawn marks, or a WebGL canvas), its title and trace count; per
``<section data-section>`` its status. ``chromium --headless --dump-dom`` prints the DOM,
from which the verdict is read; ``--screenshot`` writes a picture of the page. No Python
browser packages are needed, only the Debian ``chromium`` package (``apt-get install chromium``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelab.errors import MoelabError

log = logging.getLogger(__name__)

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MARKER = "moelab-browser-check"

_PROBE = r"""<script>
(function () {
  var errors = [];
  window.__moelabErrors = errors;
  window.addEventListener('error', function (e) {
    errors.push('error: ' + (e.message || (e.target && (e.target.src || e.target.href)) || String(e)));
  }, true);
  window.addEventListener('unhandledrejection', function (e) {
    errors.push('unhandled rejection: ' + (e.reason && (e.reason.stack || e.reason.message) || String(e.reason)));
  });
  var origError = console.error;
  console.error = function () {
    errors.push('console.error: ' + Array.prototype.map.call(arguments, String).join(' '));
    return origError.apply(console, arguments);
  };
  function marks(gd) {
    var n = 0;
    gd.querySelectorAll('.main-svg path').forEach(function (p) {
      var d = p.getAttribute('d');
      if (d && d !== 'M0,0Z' && d.length > 4 && p.closest('.trace, .barlayer, .heatmaplayer, .hm, .layer-above, .shapelayer') ) n++;
    });
    gd.querySelectorAll('.main-svg image').forEach(function (im) { if (im.getAttribute('href') || im.getAttribute('xlink:href')) n++; });
    gd.querySelectorAll('canvas').forEach(function (c) { if (c.width > 0 && c.height > 0) n++; });
    return n;
  }
  function points(gd) {  // finite data values the figure plots (a legend over empty axes has none)
    var n = 0;
    (gd._fullData || []).forEach(function (t) {
      ['y', 'z', 'values', 'x'].some(function (k) {
        var a = t[k];
        if (!a || typeof a.length !== 'number' || typeof a === 'string') return false;
        var flat = [];
        for (var i = 0; i < a.length; i++) { if (a[i] && typeof a[i].length === 'number' && typeof a[i] !== 'string') { for (var j = 0; j < a[i].length; j++) flat.push(a[i][j]); } else flat.push(a[i]); }
        var c = flat.filter(function (v) { return v !== null && v !== '' && (typeof v !== 'number' || isFinite(v)); }).length;
        n += c;
        return c > 0;
      });
    });
    return n;
  }
  function axisTitles(gd) {
    var fl = gd._fullLayout || {}, out = {};
    Object.keys(fl).forEach(function (k) {
      if (/^[xy]axis\d*$/.test(k) && fl[k] && fl[k].visible !== false && fl[k]._id) {
        var t = (fl[k].title && fl[k].title.text) || '';
        out[k] = /^Click to enter/.test(t) ? '' : t;  // plotly's placeholder for an empty title
      }
    });
    return out;
  }
  function verdict() {
    var figs = [];
    document.querySelectorAll('.plotly-graph-div').forEach(function (gd) {
      var sec = gd.closest('section');
      var fl = gd._fullLayout || null;
      var title = fl && fl.title ? (fl.title.text || '') : '';
      figs.push({
        id: gd.id,
        section: sec ? sec.getAttribute('data-section') : null,
        svg: gd.querySelectorAll('.main-svg').length,
        marks: marks(gd),
        points: points(gd),
        traces: (gd._fullData || []).length,
        title: /^Click to enter/.test(title) ? '' : title,
        axes: axisTitles(gd),
        width: gd.getBoundingClientRect().width,
        height: gd.getBoundingClientRect().height
      });
    });
    var secs = [];
    document.querySelectorAll('section[data-section]').forEach(function (s) {
      secs.push({name: s.getAttribute('data-section'), status: s.getAttribute('data-status'),
                 figures: parseInt(s.getAttribute('data-figures') || '0', 10),
                 title: (s.querySelector('h2') || {}).textContent || '',
                 read: !!s.querySelector('.read')});
    });
    return {plotly: typeof window.Plotly !== 'undefined' ? window.Plotly.version : null, figures: figs,
            sections: secs, errors: errors, height: document.documentElement.scrollHeight};
  }
  window.addEventListener('load', function () {
    setTimeout(function () {
      var pre = document.createElement('pre');
      pre.id = 'MARKER';
      pre.style.display = 'none';
      pre.textContent = JSON.stringify(verdict());
      document.body.appendChild(pre);
    }, 1500);
  });
})();
</script>""".replace("MARKER", MARKER)


@dataclass
class BrowserCheck:
    """What headless Chromium saw (see the module docstring)."""

    browser: str
    plotly: str | None
    figures: list[dict[str, Any]]
    sections: list[dict[str, Any]]
    errors: list[str]
    page_height: int
    screenshot: Path | None = None
    problems: list[str] = field(default_factory=list)
    """Every way the page fell short: JS errors, figures not drawn or unlabelled."""


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) executable on PATH, or None."""
    env = os.environ.get("MOELAB_CHROMIUM")
    if env:
        return shutil.which(env) or (env if Path(env).is_file() else None)
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _chromium(binary: str, profile: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    import os

    # Chromium's own sandbox cannot run as root; a normal user keeps it (the report may come from elsewhere)
    sandbox = ["--no-sandbox"] if os.geteuid() == 0 else []
    cmd = [binary, "--headless", *sandbox, "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
           f"--user-data-dir={profile}", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise MoelabError(f"{binary} did not finish within {timeout:.0f} s ({' '.join(cmd[-1:])}); "
                          "raise timeout= or check that the browser starts headless here.") from exc


def check_in_browser(report: str | Path, *, screenshot: str | Path | None = None, chromium: str | None = None,
                     width: int = 1200, max_height: int = 16000, timeout: float = 120.0) -> BrowserCheck:
    """Render ``report`` in headless Chromium; return what drew (and write ``screenshot``, a PNG of the page)."""
    src = Path(report)
    if not src.is_file():
        raise MoelabError(f"report {str(src)!r} does not exist; write one with `moelab demo --out FILE`.")
    binary = chromium or find_chromium()
    if binary is None:
        raise MoelabError("no Chromium found on PATH (looked for " + ", ".join(CHROMIUM_NAMES)
                          + "); install it with `apt-get install chromium` or set MOELAB_CHROMIUM.")
    text = src.read_text(encoding="utf-8")
    probed, n = re.subn(r"<head>", lambda m: m.group(0) + _PROBE, text, count=1)
    if not n:
        raise MoelabError(f"{src} has no <head>: not an HTML report written by moelab.")
    with tempfile.TemporaryDirectory(prefix="moelab-browser-") as tmp:
        page = Path(tmp) / "page.html"
        page.write_text(probed, encoding="utf-8")
        url = page.resolve().as_uri()
        r = _chromium(binary, Path(tmp) / "profile", f"--window-size={width},900", "--virtual-time-budget=20000",
                      "--dump-dom", url, timeout=timeout)
        m = re.search(rf'<pre id="{MARKER}"[^>]*>(.*?)</pre>', r.stdout, flags=re.S)
        if m is None:
            tail = "\n".join(r.stderr.strip().splitlines()[-5:])
            raise MoelabError(f"{binary} rendered {src} but the page never reported back (exit {r.returncode}); "
                              f"its last messages:\n{tail}")
        import html as _html

        data = json.loads(_html.unescape(m.group(1)))
        shot = None
        if screenshot is not None:
            shot = Path(screenshot)
            shot.parent.mkdir(parents=True, exist_ok=True)
            height = max(900, min(int(data.get("height") or 900), max_height))
            _chromium(binary, Path(tmp) / "profile", f"--window-size={width},{height}",
                      "--virtual-time-budget=20000", f"--screenshot={shot.resolve()}", url, timeout=timeout)
            if not shot.is_file() or shot.stat().st_size == 0:
                raise MoelabError(f"{binary} wrote no screenshot to {shot}.")
    result = BrowserCheck(browser=_version(binary), plotly=data["plotly"], figures=data["figures"],
                          sections=data["sections"], errors=data["errors"], page_height=int(data["height"]),
                          screenshot=shot)
    result.problems = _problems(result)
    return result


def _problems(r: BrowserCheck) -> list[str]:
    out = [f"JavaScript: {e}" for e in r.errors]
    if r.figures and not r.plotly:
        out.append("plotly.js is not loaded on the page")
    for f in r.figures:
        where = f"figure {f['id']} (section {f['section']})"
        if not f["svg"] or not f["marks"]:
            out.append(f"{where} did not draw: {f['svg']} svg layer(s), {f['marks']} drawn mark(s)")
        if not f["traces"]:
            out.append(f"{where} has no traces")
        elif not f.get("points", 1):
            out.append(f"{where} plots no data: its traces hold no finite values (empty axes with a legend)")
        if not f["title"]:
            out.append(f"{where} has no title")
        out += [f"{where}: {axis} has no title" for axis, t in f["axes"].items() if not t]
    for s in r.sections:
        drawn = sum(1 for f in r.figures if f["section"] == s["name"])
        if drawn != s["figures"]:
            out.append(f"section {s['name']} announces {s['figures']} figure(s) but the page holds {drawn}")
    return out


def _version(binary: str) -> str:
    try:
        return subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return binary
