// A content-hashed bundle name: served with Cache-Control: immutable.
(function () {
  "use strict";
  var routes = {
    "/": "Home",
    "/app/some/client/route": "A client-side route, rendered by the single-page app",
  };
  function render() {
    var el = document.getElementById("app");
    if (!el) return;
    var title = routes[location.pathname] || "Unknown route: " + location.pathname;
    el.textContent = title;
    document.title = title + " — Orisha demo app";
  }
  window.addEventListener("popstate", render);
  document.addEventListener("DOMContentLoaded", render);
  fetch("/data/planets.json")
    .then(function (r) { return r.json(); })
    .then(function (planets) { console.log("planets:", planets.map(function (p) { return p.name; }).join(", ")); });
})();
