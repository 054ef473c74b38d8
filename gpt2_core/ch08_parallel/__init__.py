"""Chapter 8, parallelism: worker processes sharing memory (``process_group``), tensor parallelism
(``tensor_parallel``; as the model step of chapter 5's engine, ``tp_runner``), a pipeline of stages
(``pipeline_parallel``), and replicas of chapter 7's server behind a router (``routing``: the policies, plain
Python; ``http_router``: ``python -m gpt2_core route``)."""
