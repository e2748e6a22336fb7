from minisgl.scheduler.request import Req
from minisgl.scheduler.scheduler import Scheduler

__all__ = ["Req", "Scheduler"]
