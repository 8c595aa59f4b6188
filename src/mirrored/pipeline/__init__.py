"""Pipeline parallelism's pieces: cutting a model into stages, schedules, running them."""
