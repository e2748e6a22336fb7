from minisgl.worker.model_runner import ModelRunner

__all__ = ["ModelRunner"]
