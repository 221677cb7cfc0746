from .fleet import DemoOptions, add_arguments, main, run_demo

__all__ = ["DemoOptions", "add_arguments", "main", "run_demo"]
