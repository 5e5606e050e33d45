"""Expert predictors, as the runtime runs them: the hidden-state MLPs (ProMoE), the first-layer auxiliary gate
(AdapMoE), the routing-only predictor, their set metrics, and the predictors file (`file.py`). Training them is
`moectl/predict/`."""
