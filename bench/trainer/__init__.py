"""The trainer's benches: speed, start-up and robustness of the bundled trainer, most of
them on a GPU (`bash bench/gpu_session.sh help` names the recipes that run them).

    reference   tok/s, MFU and start to first step by kind of start (cold, warm, artifact, resume)
    coldstart   the threaded cold start, 1 target + 3 drafter threads on one GPU; --unsafe
    soak        one run for a fixed wall time, resumed after each failure: failures per 10k steps
    multigpu    topologies T+D on one host: starts, tok/s per drafter GPU, scaling
    timeline    a profiled window's GPU time by kind of kernel, and its idle gaps
    cuda_init   the CUDA context made beside the imports or after them
    loss        the loss's vocabulary projection and its compiled chunk kernels
    masks       the BlockMask builders, checked against the dense mask
    flex        flex_attention's kernel options on the DFlash mask
    eval        speculative decoding speed against greedy decoding
    regenerate  regeneration tokens/s; regenerate -> train -> eval end to end
"""
