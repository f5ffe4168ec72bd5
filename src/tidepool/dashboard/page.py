"""The dashboard page: one HTML document with its script and styles (no external files or CDNs, so
it works offline and behind firewalls).  The server puts the current state into the page itself
(``/*INITIAL*/``), so it draws at once; a live page then opens ``api/stream`` (server-sent events),
keeps the time series, decisions and task stream it is sent, and redraws at most once per animation
frame.  A post-mortem page (``tidepool dashboard run.jsonl``) has no stream: a time slider asks
``api/state?t=`` for the run as it was at that moment."""

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tidepool dashboard</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">
<style>
body{font:13px system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2430}
header{display:flex;gap:24px;align-items:baseline;padding:10px 16px;background:#123047;color:#fff}
header h1{font-size:16px;margin:0}header .big{font-size:20px;font-weight:600}
main{display:grid;grid-template-columns:1fr 1fr;gap:12px;padding:12px}
section{background:#fff;border-radius:6px;padding:10px;box-shadow:0 1px 2px #0002;min-width:0}
section.wide{grid-column:1/3}h2{font-size:13px;margin:0 0 6px}
svg{width:100%;height:180px;display:block}table{border-collapse:collapse;width:100%}
td,th{padding:2px 6px;border-bottom:1px solid #eee;text-align:left;white-space:nowrap}
#decisions{max-height:220px;overflow:auto;margin:0;padding-left:0;list-style:none}
#decisions li{margin:2px 0}#decisions .n{display:inline-block;min-width:4.5em;color:#667;font-variant-numeric:tabular-nums}
.mem{display:flex;height:10px;width:160px;background:#eee;position:relative}.mem .lim{position:absolute;top:-2px;bottom:-2px;width:2px;background:#c00}
#replay{display:none;grid-column:1/3}#replay input{width:100%}.bar{display:flex;height:10px;width:220px;background:#eee}
.legend span{margin-right:10px}.k-launch{color:#0a7}.k-retire{color:#c60}.k-fail{color:#c00}
</style></head><body>
<header><h1>tidepool</h1>
<div>workers <span class="big" id="workers-count">-</span></div>
<div>pending <span class="big" id="pending-count">-</span></div>
<div>tasks done <span class="big" id="tasks-done">-</span></div>
<div>failed <span class="big" id="tasks-failed">-</span></div>
<div>forecast <span class="big" id="eta">-</span></div>
<div>cost <span class="big" id="cost-spent">-</span> <span id="cost-rate"></span></div>
<div id="status">connecting</div></header>
<main>
<section id="replay"><h2>Post-mortem: the run at <span id="replay-t">-</span></h2><input type="range" id="slider" min="0" max="1000" value="1000" step="1"></section>
<section><h2>Workers over time, by node type (and pending launches)</h2><svg id="chart-workers"></svg><div class="legend" id="legend-workers"></div>
<table id="types-now"><thead><tr><th>node type</th><th>busy</th><th>holding data</th><th>idle</th><th>starting</th><th>retiring</th><th>pending</th></tr></thead><tbody></tbody></table></section>
<section><h2>Completion forecast (seconds left)</h2><svg id="chart-eta"></svg></section>
<section><h2>Task groups</h2><table id="groups"><thead><tr><th>group</th><th>progress</th><th>waiting</th><th>ready</th><th>running</th><th>done</th><th>erred</th></tr></thead><tbody></tbody></table></section>
<section><h2>Scaling decisions, newest first</h2><ol id="decisions" reversed></ol></section>
<section class="wide"><h2>Task stream (last 60 s)</h2><svg id="stream"></svg></section>
<section class="wide"><h2>Workers</h2><table id="workers"><thead><tr><th>id</th><th>node type</th><th>state</th><th>resources</th><th>running</th><th>held</th><th>held bytes</th><th>spilled</th><th>memory: held, unmanaged, spilled (limit in red)</th><th>idle for</th><th>idle and empty</th></tr></thead><tbody></tbody></table></section>
</main>
<script>
"use strict";
const q = new URLSearchParams(location.search); const tok = q.get("token");
const api = p => p + (tok ? "?token=" + encodeURIComponent(tok) : "");
const COLORS = ["#1f77b4","#d62728","#2ca02c","#9467bd","#ff7f0e","#17becf","#8c564b","#e377c2"];
const INITIAL = /*INITIAL*/null;
let series = [], decisions = [], stream = [], last = null, dirty = false;
const colorOf = Object.create(null); let nColors = 0;
function color(name){ if(!(name in colorOf)) colorOf[name] = COLORS[nColors++ % COLORS.length]; return colorOf[name]; }
const GROUP_COLORS = ["#2ca02c","#1f77b4","#9467bd","#ff7f0e","#17becf","#8c564b","#e377c2","#bcbd22"];  // red means failed
const groupOf = Object.create(null); let nGroups = 0;
function groupColor(name){ if(!(name in groupOf)) groupOf[name] = GROUP_COLORS[nGroups++ % GROUP_COLORS.length]; return groupOf[name]; }
function esc(s){ return String(s).replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c])); }
function fmtBytes(n){ n = n||0; const u=["B","KiB","MiB","GiB","TiB"]; let i=0; while(n>=1024&&i<4){n/=1024;i++;} return n.toFixed(i?1:0)+" "+u[i]; }
function memBar(w){
  const spilled = w.spilled_bytes||0, inMem = Math.max(0, (w.held_bytes||0) - spilled), unmanaged = Math.max(0, (w.rss||0) - inMem);
  const lim = w.memory_limit||0, scale = Math.max(lim, inMem + unmanaged + spilled, 1), px = v => (v/scale*160).toFixed(1);
  const title = `held ${fmtBytes(inMem)}, spilled ${fmtBytes(spilled)}, unmanaged ${fmtBytes(unmanaged)}, limit ${lim ? fmtBytes(lim) : "none"}`;
  return `<div class="mem" title="${title}"><div class="m-held" style="width:${px(inMem)}px;background:#1f77b4"></div><div class="m-unmanaged" style="width:${px(unmanaged)}px;background:#aec7e8"></div><div class="m-spilled" style="width:${px(spilled)}px;background:#ff7f0e"></div>${lim ? `<div class="lim" style="left:${px(lim)}px"></div>` : ""}</div>`;
}
function total(p, nt){ const c = p.workers[nt]; return c ? c.busy+c.held+c.idle+c.starting+c.retiring : 0; }
function lines(svg, xs, sets, ymax){
  const W = svg.clientWidth||600, H = svg.clientHeight||180, pad = 28;
  const x0 = xs.length ? xs[0] : 0, x1 = xs.length ? Math.max(xs[xs.length-1], x0+1) : 1;
  ymax = Math.max(1, ymax);
  const X = x => pad + (x-x0)/(x1-x0)*(W-pad-6), Y = y => H-16 - y/ymax*(H-26);
  let out = `<line x1="${pad}" y1="${H-16}" x2="${W}" y2="${H-16}" stroke="#999"/>` +
            `<text x="2" y="12" font-size="10">${Math.round(ymax*10)/10}</text><text x="2" y="${H-18}" font-size="10">0</text>` +
            `<text x="${W-60}" y="${H-2}" font-size="10">t=${Math.round(x1 - (last ? last.t0 : 0))}s</text>`;
  for (const s of sets){
    const pts = []; xs.forEach((x,i) => { if (s.ys[i] != null) pts.push(X(x).toFixed(1)+","+Y(s.ys[i]).toFixed(1)); });
    out += `<polyline fill="none" stroke="${s.color}" stroke-width="2" ${s.dash?'stroke-dasharray="4 3"':''} points="${pts.join(" ")}"/>`;
  }
  svg.innerHTML = out;
}
function render(){
  dirty = false; if (!last) return;
  const p = last.point, types = new Set();
  series.forEach(s => { Object.keys(s.workers).forEach(t => types.add(t)); Object.keys(s.pending||{}).forEach(t => types.add(t)); });
  let now = 0, pend = 0; Object.keys(p.workers).forEach(t => now += total(p, t)); Object.values(p.pending||{}).forEach(n => pend += n);
  document.getElementById("workers-count").textContent = now;
  document.getElementById("pending-count").textContent = pend;
  // each task once, as its group counts it (counters.finished counts recomputes too)
  document.getElementById("tasks-done").textContent = Object.values(last.groups||{}).reduce((n, c) => n + (c.memory||0), 0);
  document.getElementById("tasks-failed").textContent = last.counters.erred||0;
  document.getElementById("eta").textContent = p.eta == null ? "-" : p.eta.toFixed(1)+" s";
  const c = p.cost; document.getElementById("cost-spent").textContent = c == null ? "-" : c.spent.toFixed(3)+(c.budget == null ? "" : " of "+c.budget);
  document.getElementById("cost-rate").textContent = c == null ? "" : "now "+c.rate.toFixed(2)+"/h"+(c.max_rate == null ? "" : " (max "+c.max_rate+"/h)");
  const xs = series.map(s => s.t), sets = []; let ymax = 1;
  for (const t of types){
    const ys = series.map(s => total(s, t)), ps = series.map(s => (s.pending||{})[t]||0);
    ymax = Math.max(ymax, ...ys, ...ps);
    sets.push({color: color(t), ys}); sets.push({color: color(t), ys: ps, dash: true});
  }
  lines(document.getElementById("chart-workers"), xs, sets, ymax);
  document.getElementById("legend-workers").innerHTML = [...types].map(t => `<span style="color:${color(t)}">&#9632; ${esc(t)}</span>`).join("") + "<span>dashed: pending</span>";
  document.querySelector("#types-now tbody").innerHTML = [...types].map(t => { const c = p.workers[t] || {busy:0,held:0,idle:0,starting:0,retiring:0};
    return `<tr><td style="color:${color(t)}">${esc(t)}</td><td>${c.busy}</td><td>${c.held}</td><td>${c.idle}</td><td>${c.starting}</td><td>${c.retiring}</td><td>${(p.pending||{})[t]||0}</td></tr>`; }).join("");
  const etas = series.map(s => s.eta); lines(document.getElementById("chart-eta"), xs, [{color:"#123047", ys: etas}], Math.max(1, ...etas.filter(e => e != null)));
  const g = last.groups, rows = [];
  for (const [name, c] of Object.entries(g)){
    const waiting=c.waiting||0, ready=(c.ready||0)+(c["no-worker"]||0), running=c.running||0, done=c.memory||0, erred=c.erred||0;
    const all = Math.max(1, waiting+ready+running+done+erred), w = v => (v/all*220).toFixed(0);
    rows.push(`<tr><td>${esc(name)}</td><td><div class="bar"><div style="width:${w(done)}px;background:#2ca02c"></div><div style="width:${w(running)}px;background:#1f77b4"></div><div style="width:${w(ready)}px;background:#aec7e8"></div><div style="width:${w(erred)}px;background:#d62728"></div></div></td><td>${waiting}</td><td>${ready}</td><td>${running}</td><td>${done}</td><td>${erred}</td></tr>`);
  }
  document.querySelector("#groups tbody").innerHTML = rows.slice(0, 50).join("");
  document.getElementById("decisions").innerHTML = decisions.slice(-200).reverse().map(d => {
    const cls = d.kind.startsWith("launch") ? "k-launch" : d.kind.startsWith("retire") ? "k-retire" : d.kind.includes("fail") ? "k-fail" : "";
    const what = d.node_type ? ` ${esc(d.node_type)}${d.nodes ? " x"+esc(d.nodes) : ""}` : d.worker ? " "+esc(d.worker) : "";
    return `<li class="decision ${cls}"><span class="n">#${d.i + 1}</span> t=${(Number(d.t) - last.t0).toFixed(1)}s <b>${esc(d.kind)}</b>${what}: ${esc(d.reason||d.outcome||"")}</li>`;
  }).join("");
  const ws = last.workers;
  document.querySelector("#workers tbody").innerHTML = ws.map(w => `<tr class="worker-row"><td>${esc(w.name||w.id)}</td><td>${esc(w.node_type)}</td><td>${esc(w.state)}</td><td>${esc(Object.entries(w.resources).map(([k,v]) => k+"="+v).join(", "))}</td><td>${w.running}</td><td>${w.held_keys}</td><td>${fmtBytes(w.held_bytes)}</td><td${w.spill_disabled?` title="${esc(w.spill_disabled)}"`:""}>${fmtBytes(w.spilled_bytes)}${w.spill_disabled?" (spilling off)":""}</td><td>${memBar(w)}</td><td>${w.idle_for==null?"-":w.idle_for+" s"}</td><td>${w.idle_and_empty?"yes":""}</td></tr>`).join("");
  const svg = document.getElementById("stream"), W = svg.clientWidth||900, H = svg.clientHeight||180;
  const t1 = last.now, t0 = t1 - 60, rowsOf = {}; let nrow = 0;
  const recent = stream.filter(s => s.start + s.duration >= t0);
  recent.forEach(s => { if (!(s.worker in rowsOf)) rowsOf[s.worker] = nrow++; });
  const rh = Math.max(3, Math.min(18, (H-4)/Math.max(1,nrow)));
  svg.innerHTML = recent.map(s => { const x = (Math.max(s.start,t0)-t0)/60*W, w = Math.max(1, s.duration/60*W);
    return `<rect x="${x.toFixed(1)}" y="${(rowsOf[s.worker]*rh+2).toFixed(1)}" width="${w.toFixed(1)}" height="${(rh-1).toFixed(1)}" fill="${s.ok?groupColor(s.group):"#d62728"}"><title>${esc(s.key)} on ${esc(s.worker)}: ${esc(s.duration)}s</title></rect>`; }).join("");
}
function schedule(){ if (!dirty){ dirty = true; requestAnimationFrame(render); } }
function connect(){
  // continue from what the first response carried: no decision or task drawn twice
  const from = last ? "stream_after=" + last.stream_next + "&decisions_after=" + last.decisions_next : "";
  const es = new EventSource(api("api/stream") + (from ? (tok ? "&" : "?") + from : ""));
  es.addEventListener("history", ev => { series = JSON.parse(ev.data).history; schedule(); });
  es.onopen = () => { document.getElementById("status").textContent = "live"; };
  es.onmessage = ev => {
    const v = JSON.parse(ev.data); last = v;
    series.push(v.point); if (series.length > 1200) series = series.slice(-1200);
    decisions.push(...v.decisions); if (decisions.length > 1000) decisions = decisions.slice(-1000);
    stream.push(...v.stream); if (stream.length > 4000) stream = stream.slice(-4000);
    schedule();
  };
  // reconnect by hand, from the cursors reached (the browser's own retry would replay from the first)
  es.onerror = () => { document.getElementById("status").textContent = "reconnecting"; es.close(); setTimeout(connect, 1000); };
}
function fromInitial(init){
  last = init.view; series = init.history || []; decisions = (last.decisions || []).slice(); stream = (last.stream || []).slice();
  render();
}
function replay(init){
  const box = document.getElementById("replay"), slider = document.getElementById("slider"), label = document.getElementById("replay-t");
  box.style.display = "block"; document.getElementById("status").textContent = "post-mortem";
  const [a, b] = init.range, at = v => a + (b - a) * v / 1000;
  const show = () => { label.textContent = "t=" + (at(+slider.value) - a).toFixed(1) + " s of " + (b - a).toFixed(1) + " s"; };
  let seq = 0;
  slider.addEventListener("input", () => { show(); const mine = ++seq;
    fetch(api("api/state") + (tok ? "&" : "?") + "t=" + at(+slider.value)).then(r => r.json()).then(v => {
      if (mine !== seq) return; fromInitial(v); }); });
  show();
}
if (INITIAL){ fromInitial(INITIAL); }
if (INITIAL && INITIAL.live === false){ replay(INITIAL); } else { connect(); }
</script></body></html>
"""
