"""`moectl train-predictor`: training the expert predictors (`moectl/predictors/`) on profiled traces."""
