"""The HTML document: figures collected as data, plotly.js inlined, the CSS, and a
Content-Security-Policy that allows only the page's own scripts (by hash)."""
from __future__ import annotations

import base64
import hashlib
from functools import lru_cache

from memdoctor.report.html.escape import esc, script_json


class Page:
    """Collects the figures; renders the document with its scripts and their CSP hashes."""

    def __init__(self) -> None:
        self.figures: list[dict] = []

    def figure(self, data: list, layout: dict, height: int = 420, css: str = "chart") -> str:
        div = f"fig{len(self.figures)}"
        layout = {"height": height, "margin": {"l": 70, "r": 30, "t": 50, "b": 50},
                  "paper_bgcolor": "#ffffff", "plot_bgcolor": "#ffffff",
                  "font": {"family": "system-ui, -apple-system, Segoe UI, sans-serif", "size": 12}, **layout}
        self.figures.append({"div": div, "data": data, "layout": layout})
        return f'<div id="{div}" class="{css}" style="min-height:{height}px"></div>'

    def html(self, title: str, body: str) -> str:
        guard = _GUARD_JS
        plotly = _plotly_js()
        app = _APP_JS
        hashes = " ".join(f"'sha256-{_sha256(s)}'" for s in (guard, plotly, app))
        csp = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; "
               "img-src data: blob:; font-src data:; connect-src 'none'; frame-src 'none'; "
               "object-src 'none'; base-uri 'none'; form-action 'none'")
        data = script_json({"figures": self.figures})
        return (
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{csp}\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
            f"<script>{guard}</script>\n<main>\n{body}\n</main>\n"
            f"<script type=\"application/json\" id=\"memdoctor-data\">{data}</script>\n"
            f"<script>{plotly}</script>\n<script>{app}</script>\n</body>\n</html>\n")


@lru_cache(maxsize=1)
def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs
    js = get_plotlyjs().replace("\r\n", "\n").replace("\r", "\n")   # as the HTML parser sees it
    if "</script" in js.lower():      # never expected; refuse rather than break the page
        raise RuntimeError("plotly.js contains '</script', cannot inline it")
    return js


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode()


_CSS = """
:root { --fg:#1d1d1f; --muted:#666; --line:#e3e3e3; --bad:#c62828; --good:#2e7d32; }
body { margin:0; color:var(--fg); background:#f6f7f9; font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif; }
main { max-width:1280px; margin:0 auto; padding:16px 24px 40px; }
header, section { background:#fff; border:1px solid var(--line); border-radius:8px; padding:14px 18px; margin:14px 0; }
h1 { font-size:20px; margin:0 0 6px; } h2 { font-size:17px; margin:0 0 8px; } h3 { font-size:14px; margin:10px 0 6px; }
.headline { font-size:16px; font-weight:600; margin:4px 0 10px; }
.bad { color:var(--bad); } .good { color:var(--good); }
dl.facts { display:grid; grid-template-columns:max-content 1fr; gap:3px 14px; margin:0; }
dl.facts dt { color:var(--muted); } dl.facts dd { margin:0; overflow-wrap:anywhere; }
pre.oom { white-space:pre-wrap; overflow-wrap:anywhere; background:#fff5f5; border-left:3px solid var(--bad);
          padding:8px 10px; margin:10px 0 0; font-size:12px; }
code { font:12px ui-monospace,SFMono-Regular,Menlo,monospace; background:#f1f1f3; padding:0 3px; border-radius:3px; }
.note { color:var(--muted); margin:2px 0 8px; }
article.finding { border-top:1px solid var(--line); padding:6px 0 8px; }
article.finding.first { border-top:none; }
article.finding h3 { font-size:15px; } code.rule { font-size:13px; background:#fde7e7; color:#8e1b1b; }
table { border-collapse:collapse; margin:6px 0; font-size:13px; }
th, td { text-align:left; padding:3px 10px 3px 0; border-bottom:1px solid var(--line); vertical-align:top; }
td.num { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
tr.total td { font-weight:600; }
table.tensors td:first-child, table.tensors td:nth-child(6) { overflow-wrap:anywhere; max-width:280px; }
.swatch { display:inline-block; width:10px; height:10px; border-radius:2px; margin-right:6px; }
.cols { display:flex; gap:28px; flex-wrap:wrap; align-items:flex-start; } .cols .grow { flex:1; min-width:420px; }
.pair { display:flex; gap:12px; flex-wrap:wrap; } .chart.half { flex:1 1 560px; min-width:0; }
p.legend { display:flex; flex-wrap:wrap; gap:4px 16px; font-size:12px; color:var(--muted); margin:4px 0; }
.swatch.band { border:1px solid #ccc; }
footer { color:var(--muted); font-size:12px; margin:10px 2px; }
"""

# Runs first: records script errors, blocked network requests and unhandled rejections on
# <body data-*> so a headless browser (and a curious reader) can see them.
_GUARD_JS = """(function(){
var b=document.body;function rec(k,m){var p=b.getAttribute('data-'+k);b.setAttribute('data-'+k,(p?p+' | ':'')+String(m).slice(0,300));}
window.addEventListener('error',function(e){rec('errors',e.message||e);});
window.addEventListener('unhandledrejection',function(e){rec('errors',e.reason&&e.reason.message||e.reason);});
document.addEventListener('securitypolicyviolation',function(e){rec('blocked',e.violatedDirective+' '+e.blockedURI);});
window.__memdoctorRecord=rec;})();"""

# Draws every figure of the JSON block; marks <body data-rendered=N data-expected=M
# data-render-ms=T> when all are drawn.
_APP_JS = """(function(){
var b=document.body,rec=window.__memdoctorRecord;
try{
var data=JSON.parse(document.getElementById('memdoctor-data').textContent);
var config={displaylogo:false,responsive:true,showLink:false,showSendToCloud:false,
modeBarButtonsToRemove:['sendDataToCloud','lasso2d','select2d']};
b.setAttribute('data-expected',String(data.figures.length));
var jobs=data.figures.map(function(f){var div=document.getElementById(f.div);
return Plotly.newPlot(div,f.data,f.layout,config).then(function(){return div.querySelector('svg.main-svg')?1:0;});});
Promise.all(jobs).then(function(r){
b.setAttribute('data-rendered',String(r.reduce(function(a,x){return a+x;},0)));
b.setAttribute('data-render-ms',String(Math.round(performance.now())));
},function(e){rec('errors',e&&e.message||e);});
}catch(e){rec('errors',e&&e.message||e);}
})();"""
