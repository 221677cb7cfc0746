from .server import FakeUpstream, add_arguments, run, start_fake_upstream

__all__ = ["FakeUpstream", "add_arguments", "run", "start_fake_upstream"]
