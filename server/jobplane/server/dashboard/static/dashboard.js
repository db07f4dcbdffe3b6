// jobplane dashboard: live updates over server-sent events (no inline scripts: CSP).
"use strict";

(function () {
  function text(el, value) { if (el) { el.textContent = value; } }
  function status(message) { text(document.getElementById("live-status"), message); }
  function percent(p) { return Math.round(p * 1000) / 10 + "%"; }
  function setState(el, state) {
    if (!el) { return; }
    el.textContent = state;
    el.className = "state state-" + state;
  }
  function cell(row, value) {
    var td = document.createElement("td");
    td.textContent = value;
    row.appendChild(td);
    return td;
  }
  function follow(url, handlers) {
    var source = new EventSource(url);
    source.addEventListener("open", function () { status("live"); });
    source.addEventListener("error", function () {
      status(source.readyState === EventSource.CLOSED ? "not live" : "reconnecting…");
    });
    source.addEventListener("signedout", function () { source.close(); window.location.assign("/signin"); });
    source.addEventListener("notfound", function () { source.close(); status("not found"); });
    source.addEventListener("failed", function (e) { source.close(); status("stopped: " + JSON.parse(e.data).message); });
    Object.keys(handlers).forEach(function (name) {
      source.addEventListener(name, function (e) { handlers[name](JSON.parse(e.data), source); });
    });
    return source;
  }

  function jobPage() {
    var root = document.getElementById("job");
    if (!root || root.dataset.terminal === "yes") { return; }
    var events = document.getElementById("events");
    var lastSeq = Number(root.dataset.seq);
    follow(root.dataset.live, {
      job: function (ev) {
        if (ev.seq <= lastSeq) { return; }
        lastSeq = ev.seq;
        root.dataset.seq = String(ev.seq);
        document.getElementById("job-progress").value = ev.progress;
        text(document.getElementById("job-percent"), percent(ev.progress));
        text(document.getElementById("job-message"), ev.message);
        setState(document.getElementById("job-state"), ev.state);
        var row = document.createElement("tr");
        row.dataset.seq = String(ev.seq);
        cell(row, ev.seq);
        cell(row, ev.time.slice(11, 23));
        cell(row, ev.type + (ev.stage ? " " + ev.stage : ""));
        cell(row, ev.state);
        cell(row, percent(ev.progress));
        cell(row, ev.message);
        events.insertBefore(row, events.firstChild);
        while (events.children.length > 500) { events.removeChild(events.lastChild); }
        if (ev.type === "started" || ev.type === "retry_scheduled" || ev.type === "stage_succeeded") {
          status("live");
        }
      },
      end: function (_data, source) {
        source.close();
        status("ended");
        // The result, the error and the attempts are read once, as they ended.
        window.setTimeout(function () { window.location.reload(); }, 300);
      }
    });
  }

  function jobsPage() {
    var table = document.getElementById("jobs");
    if (!table) { return; }
    var rows = {};
    Array.prototype.forEach.call(table.querySelectorAll("tr[data-job]"), function (row) {
      rows[row.dataset.job] = row;
    });
    function update(ev) {
      var row = rows[ev.job];
      if (!row || Number(row.dataset.seq) > ev.seq) { return; }
      row.dataset.seq = String(ev.seq);
      setState(row.querySelector("[data-field=state]"), ev.state);
      row.querySelector("[data-field=progress]").value = ev.progress;
      text(row.querySelector("[data-field=percent]"), Math.round(ev.progress * 100) + "%");
      text(row.querySelector("[data-field=message]"), ev.message);
    }
    var cap = Number(document.getElementById("counts").dataset.cap);
    follow(table.dataset.live, {
      snapshot: function (jobs) { jobs.forEach(update); },
      jobs: function (events) { events.forEach(update); },
      counts: function (counts) {
        Object.keys(counts).forEach(function (state) {
          var el = document.querySelector("[data-count=" + state + "]");
          text(el, counts[state] + (counts[state] >= cap ? "+" : ""));
        });
      }
    });
  }

  function eventsPage() {
    var body = document.getElementById("domain-events");
    if (!body) { return; }
    follow(body.dataset.live, {
      event: function (data) {
        var env = data.envelope;
        var row = document.createElement("tr");
        cell(row, env.timestamp);
        cell(row, env.event_type);
        var jobCell = cell(row, "");
        if (data.job) {
          var link = document.createElement("a");
          link.href = "/jobs/" + data.job;
          link.textContent = "jobs/" + data.job;
          jobCell.appendChild(link);
        }
        cell(row, env.correlation_id);
        var pre = document.createElement("code");
        pre.textContent = JSON.stringify(env.payload);
        row.appendChild(document.createElement("td")).appendChild(pre);
        body.insertBefore(row, body.firstChild);
        while (body.children.length > 500) { body.removeChild(body.lastChild); }
      }
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var page = document.body.dataset.page;
    if (page === "job") { jobPage(); }
    if (page === "jobs") { jobsPage(); }
    if (page === "events") { eventsPage(); }
  });
})();
