"""Resource evidence beside the step phases: process, host and GPU metrics of a run's window."""
