from minisgl.sampling.params import SamplingParams
from minisgl.sampling.sampler import Sampler, SampleOutput

__all__ = ["SamplingParams", "Sampler", "SampleOutput"]
