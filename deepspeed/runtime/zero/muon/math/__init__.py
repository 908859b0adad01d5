"""Muon's math: pure functions of tensors (Newton-Schulz and its coefficient schedules, the per-shape choice, the
update rules, NorMuon's normalisation). No streams, graphs, ranks or workspaces of its own; never imports the kernels
or the executor (``ns_ops`` is where the kernels plug in)."""
