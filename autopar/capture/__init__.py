"""Capture stage: model + example inputs -> ModelGraph (being built: issue 2)."""


class ModelGraph:  # replaced by the real one in autopar/capture/graph.py
    pass


def capture(model, example_inputs, **kwargs):
    raise NotImplementedError("autopar.capture is being built (issue 2)")
