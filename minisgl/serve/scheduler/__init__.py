from minisgl.serve.scheduler.request import Req
from minisgl.serve.scheduler.scheduler import Scheduler

__all__ = ["Req", "Scheduler"]
