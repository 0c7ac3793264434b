"""The instruments behind benchmark.py: they measure speed and never run in the training path.

    cpu_paths            the measured paths (MindSpore, ours, PyTorch, onnxruntime workers), their labels
    timing               medians and latency percentiles of timed calls
    mindspore_runner     the training step train.py builds, timed in GRAPH mode; the worker's device set-up
    torch_runner         the same network in PyTorch eager
    onnx_runner          the ONNX export under onnxruntime; its int8 files
    worker               the subprocess protocol: the measuring process's command line, replies, handle
    serve                a framework's measuring process: answers measure, export and data
    breakdown            one training step taken apart by oneDNN primitive kind
    end_to_end           training through the real pipeline, and each pipeline alone
    capacity             this CPU's peak and the path train.py takes; the model's achieved rates
    configurations       one (net, batch, size) configuration measured, with its ratios
    pipelines            our input pipeline and MindSpore's native one, timed in one process
    pipeline_data        the files the pipeline comparison reads
    pipeline_comparison  the pipeline comparison across cores and workers; cores per Ascend card
    storage              storage system calls per sample, counted by strace
    report               the printed tables
"""
