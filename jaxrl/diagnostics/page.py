"""Building blocks of the self-contained HTML reports (the run report and the sweep report): inline CSS, escaping,
tables, PNG images as data URIs."""

from __future__ import annotations

import base64
import html
from typing import Any, Optional, Sequence

__all__ = ["CSS", "escape", "img", "table"]

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;color:#222;
line-height:1.4;padding:0 12px}
h1{font-size:24px;margin-bottom:4px}h2{font-size:19px;border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:34px}
h3{font-size:15px;margin-top:18px}
table{border-collapse:collapse;margin:8px 0 14px;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:right;vertical-align:top}
th{background:#f2f2f2}td.l,th.l{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:6px 0}
.flag{padding:7px 10px;margin:5px 0;border-left:6px solid;border-radius:3px;font-size:14px}
.error{background:#fdecea;border-color:#c62828}.warning{background:#fff8e1;border-color:#f9a825}
.info{background:#e8f1fb;border-color:#1e88e5}.sev{font-weight:bold;text-transform:uppercase;font-size:11px;
margin-right:6px}.code{font-family:monospace;font-size:12px;color:#555}
.muted{color:#777;font-size:13px}pre{background:#f7f7f7;padding:8px;overflow-x:auto;font-size:12px;
white-space:pre-wrap;word-break:break-word;max-height:420px}
.sbs{display:grid;grid-template-columns:1fr 1fr;gap:10px}.sbs pre{margin:0}
.tag{display:inline-block;padding:1px 6px;border-radius:3px;background:#eee;font-family:monospace;font-size:12px}
nav a{margin-right:12px;font-size:13px}
"""


def escape(x: Any) -> str:
    return html.escape(str(x), quote=True)


def img(png: Optional[bytes], alt: str) -> str:
    if not png:
        return ""
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def table(head: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Cells are already-escaped HTML; the first ``left`` columns are left-aligned."""
    th = "".join(f'<th class="{"l" if i < left else ""}">{escape(h)}</th>' for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{c}</td>' for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"
