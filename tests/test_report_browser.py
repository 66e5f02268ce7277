"""The report in a real browser: headless Chromium loads it without console
errors, draws its charts (non-blank screenshot with the charts' colours in
it, SVG elements in the live DOM) and prints it to PDF.

Needs /usr/bin/chromium (Debian package `chromium`, installed by .ci/run).
Where it is absent these tests skip, naming what to install; under CI (the
`CI` variable set) they fail instead, so a CI run can never pass with the
browser checks silently left out.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from autopar.report import render_html
from autopar.report.palette import MEMORY, PHASE, stage_color
from test_report_fixtures import make_plan, make_small_plan

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(autouse=True)
def _needs_chromium():
    if CHROMIUM is not None:
        return
    why = "chromium is not installed: `apt-get install chromium` (Debian) runs these browser checks"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; under CI it is required (.ci/run installs it)")
    pytest.skip(why)


FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]


def chromium(tmp_path, page, *extra, timeout=90) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"  # a fresh profile per launch
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *extra, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def console_messages(stderr: str) -> list[str]:
    """Lines Chromium logs for the page's console (errors, CSP violations, uncaught exceptions)."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def decode_png(path) -> np.ndarray:
    """RGB(A) pixels of an 8-bit non-interlaced PNG (what Chromium writes), with zlib + numpy only."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + n
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and interlace == 0 and color in (2, 6), header
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + width * bpp)
    out = np.zeros((height, width * bpp), dtype=np.uint8)
    prev = np.zeros(width * bpp, dtype=np.int32)
    for y in range(height):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if f == 0:
            cur = line
        elif f == 1:  # Sub: running sum along each channel
            cur = np.cumsum(line.reshape(width, bpp), axis=0).reshape(-1) % 256
        elif f == 2:
            cur = (line + prev) % 256
        else:  # Average / Paeth depend on the reconstructed left neighbour: byte by byte
            cur, a_row, b_row = line.tolist(), [0] * bpp, prev.tolist()
            for i in range(width * bpp):
                a = cur[i - bpp] if i >= bpp else 0
                b = b_row[i]
                if f == 3:
                    cur[i] = (cur[i] + (a + b) // 2) % 256
                else:
                    c = b_row[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) % 256
            cur = np.array(cur, dtype=np.int32)
        out[y] = cur
        prev = cur
    return out.reshape(height, width, bpp)[:, :, :3]


def has_colour(pixels: np.ndarray, hex_colour: str, at_least: int) -> bool:
    rgb = tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return int(np.all(pixels == rgb, axis=2).sum()) >= at_least


def test_console_detector_catches_errors(tmp_path):
    """Negative control: the console scan sees script errors and blocked fetches."""
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'><meta http-equiv='Content-Security-Policy' "
                    "content=\"default-src 'none'; script-src 'unsafe-inline'\"><title>x</title></head><body>"
                    "<img src='http://example.invalid/x.png' alt=''><script>throw new Error('boom')</script></body></html>")
    messages = console_messages(chromium(tmp_path, page, "--dump-dom").stderr)
    assert any("boom" in m for m in messages)
    assert any("Content Security Policy" in m for m in messages)


def test_report_loads_without_console_errors_and_draws_its_charts(tmp_path):
    plan = make_small_plan()
    page = tmp_path / "plan.html"
    page.write_text(render_html(plan), encoding="utf-8")

    dom = chromium(tmp_path, page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert console_messages(dom.stderr) == []
    live = dom.stdout
    for cls in ("mesh-detail", "gantt", "memory"):
        assert re.search(rf'<svg[^>]*class="chart {cls}"', live), cls
    assert len(re.findall(r'<rect[^>]*class="op (fwd|bwd)"', live)) == 2 * plan.mesh.pp * plan.num_micro_batches
    assert len(re.findall(r'<rect[^>]*class="mem ', live)) == 5 * plan.mesh.pp

    shot = tmp_path / "plan.png"
    run = chromium(tmp_path, page, f"--screenshot={shot}", "--window-size=1280,2600")
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    assert console_messages(run.stderr) == []
    pixels = decode_png(shot)
    assert pixels.shape[:2] == (2600, 1280)
    assert pixels.std() > 20, "screenshot is blank"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
    # the charts were painted: their fill colours cover real areas of the screenshot
    assert has_colour(pixels, stage_color(0, plan.mesh.pp), 2000), "mesh not drawn"
    assert has_colour(pixels, PHASE["fwd"], 1000) and has_colour(pixels, PHASE["bwd"], 2000), "pipeline timeline not drawn"
    assert has_colour(pixels, MEMORY["optimizer"], 2000), "memory bars not drawn"


def test_175b_report_loads_and_prints(tmp_path):
    page = tmp_path / "plan.html"
    page.write_text(render_html(make_plan()), encoding="utf-8")
    dom = chromium(tmp_path, page, "--dump-dom")
    assert dom.returncode == 0 and console_messages(dom.stderr) == []
    assert len(re.findall(r'<g class="node">', dom.stdout)) == 128  # every node of the 1,024-GPU cluster
    pdf = tmp_path / "plan.pdf"
    run = chromium(tmp_path, page, f"--print-to-pdf={pdf}", "--no-pdf-header-footer")
    assert run.returncode == 0 and pdf.exists(), run.stderr[-2000:]
    body = pdf.read_bytes()
    assert body.startswith(b"%PDF")
    pages = len(re.findall(rb"/Type\s*/Page[^s]", body))
    assert 2 <= pages <= 30, pages


@pytest.mark.parametrize("sample", sorted(p.name for p in (ROOT / "reports").glob("*.html")))
def test_sample_reports_load_cleanly(tmp_path, sample):
    dom = chromium(tmp_path, ROOT / "reports" / sample, "--dump-dom")
    assert dom.returncode == 0 and console_messages(dom.stderr) == []
    for cls in ("mesh-detail", "gantt", "memory"):
        assert re.search(rf'<svg[^>]*class="chart {cls}"', dom.stdout), cls


def test_hostile_module_names_stay_text_in_the_browser(tmp_path):
    hostile = "<script>alert(1)</script>"
    plan = make_small_plan(layer_name=hostile + "{i}", module_name=hostile, name=hostile)
    page = tmp_path / "hostile.html"
    page.write_text(render_html(plan), encoding="utf-8")
    dom = chromium(tmp_path, page, "--dump-dom")
    assert dom.returncode == 0 and console_messages(dom.stderr) == []
    assert "<script" not in dom.stdout.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom.stdout
