// Loaded last: the model's name, whether the Runs tab shows, the tab the address names.
"use strict";

fetch("/api/info", { headers: headers() }).then(async (response) => {
  if (!response.ok) return;
  const info = await response.json();
  $("model").textContent = info.model;
  $("tab-runs").style.display = info.runs ? "" : "none";
  for (const hook of infoHooks) hook(info);
  if (location.hash === "#runs" && info.runs) showTab("runs");
});
