"""report.html in a real headless browser (Debian's chromium, installed by .ci/install-chromium):
the page renders with no network, every clause x backend cell has its status's colour on the
screen and links to evidence that exists, and the verdict and the gate decision are at the top."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from test_conformance_results import ABSENT, AVAILABLE, case, proven

from retro.conformance import html, registry, results

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# CI installs it (.ci/install-chromium): there a missing browser fails the test, never skips it
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"),
    reason="no chromium on this machine (.ci/install-chromium installs Debian's; CI requires it)",
)
WIDTH, HEIGHT = 1400, 4000
#: what the browser measures on the rendered page: every cell's status, box and painted colour
PROBE = """<script>
const out = {cells: [], ids: [...document.querySelectorAll('[id]')].map(e => e.id),
  verdicts: [...document.querySelectorAll('[data-verdict]')].map(e => e.dataset.verdict),
  decisions: [...document.querySelectorAll('[data-decision]')].map(e => e.dataset.decision)};
for (const td of document.querySelectorAll('td.cell')) {
  const r = td.getBoundingClientRect();
  out.cells.push({clause: td.dataset.clause, backend: td.dataset.backend, status: td.dataset.status,
    href: td.querySelector('a').getAttribute('href'), colour: getComputedStyle(td).backgroundColor,
    x: r.left, y: r.top, w: r.width, h: r.height});
}
const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def _package() -> dict:
    cs = [
        *proven("a", "CANCEL-03"),  # BASE-01, partly implemented, stays "not covered" with no case
        case("b", ["BASE-02"], "fail", message="diverged <here>"),
        case("c", ["BASE-03"], "crash", message="the interpreter died"),
        case("d", ["CANCEL-01"], "not supported", message="no such op"),
        case("e", ["CANCEL-02"], "expected failure", message="driver bug"),
    ]
    cs[0]["bounds"] = [{"bound": "logits NMSE", "observation": "logits", "error": 1e-9, "limit": 1e-6}]
    selected = ["BASE-01", "BASE-02", "BASE-03", "CANCEL-01", "CANCEL-02", "CANCEL-03"]
    return results.aggregate({"start_time": "t", "seed": 0}, {"cpu": AVAILABLE, "vulkan": ABSENT}, cs, selected)


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None, "chromium is not installed (.ci/install-chromium)"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",  # root in CI
        "--disable-gpu",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--window-size={WIDTH},{HEIGHT}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


class _Probe(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.inside, self.text = False, ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.inside = tag == "pre" and ("id", "probe") in attrs

    def handle_data(self, data: str) -> None:
        if self.inside:
            self.text += data


def _rgb(css: str) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in css[css.index("(") + 1 : css.index(")")].split(",")[:3])
    return r, g, b


def _hex(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def test_the_report_renders_every_cell_in_its_status_colour_with_links_to_its_evidence(tmp_path: Path) -> None:
    from PIL import Image

    res = _package()
    results.write_all(res, tmp_path)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "http://" not in page and "https://" not in page and "<script" not in page  # self-contained
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")

    parser = _Probe()
    parser.feed(_chromium("--virtual-time-budget=5000", "--dump-dom", probed.as_uri()).stdout)
    seen = json.loads(parser.text)
    _chromium(f"--screenshot={tmp_path / 'shot.png'}", probed.as_uri())
    shot = Image.open(tmp_path / "shot.png").convert("RGB")

    assert seen["verdicts"] == ["not certified", "not available"]
    assert seen["decisions"] == ["refuse"]
    cells = {(c["clause"], c["backend"]): c for c in seen["cells"]}
    assert len(cells) == 2 * len(registry.clauses())
    ids = set(seen["ids"])
    for (cid, backend), c in cells.items():
        assert c["status"] == res["clauses"][cid][backend]
        assert c["href"] == f"#{html.anchor(cid, backend)}" and c["href"][1:] in ids, c
        assert _rgb(c["colour"]) == _hex(html.COLOURS[c["status"]]), c
        assert c["w"] > 20 and c["h"] > 10, c
    # on the screen: each status of the grid's first rows painted where the browser laid its cell out
    want = {"pass", "fail", "crash", "not supported", "expected failure", "not covered", "not available"}
    painted = set()
    for c in seen["cells"]:
        x, y = int(c["x"] + 3), int(c["y"] + c["h"] / 2)
        if y < HEIGHT - 10 and c["status"] in want:
            pixel = shot.getpixel((x, y))
            assert max(abs(p - q) for p, q in zip(pixel, _hex(html.COLOURS[c["status"]]))) <= 8, (c, pixel)
            painted.add(c["status"])
    assert painted == want
