"""Cache planning (`moectl plan-cache`): budget split, per-layer cost curves, the DP, plan.yaml, presets and the
scoreboard. See docs/architecture.md "Cache planning"."""
