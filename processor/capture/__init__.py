"""Deep profiler capture (issue 33) on the processor side: the book of requests, the files kept
with a run, the trigger policy, and the digest that turns two ranks' captures into evidence."""
