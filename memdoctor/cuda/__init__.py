"""The CUDA layer: the caching allocator as modelled, kernel workspaces, the attention kernel
CUDA's dispatcher picks, NVML device facts and the Triton kernels. It knows CUDA and nothing
above it."""
