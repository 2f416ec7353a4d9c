"""Quantization algorithms: how a float weight becomes a QTensor.

Each method is a config + apply pair that reacts to the events of one layer-by-layer
calibration loop (``lowbit.models.calibrate``) and never drives it.
"""
