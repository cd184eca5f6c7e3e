# Environment for multi-node runs; source it on every node before launching.
#   source launch/env.sh
# NCCL and RCCL (ROCm's NCCL) read the same NCCL_* variables; both are torch's "nccl" backend.

# Never use NVLink multicast (NVLS): it is not needed here and can wedge shared NVSwitch systems.
export NCCL_NVLS_ENABLE=0
# Surface collective errors and timeouts as exceptions instead of hangs (deploy.timeout_s bounds the wait).
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# The network interface for the bootstrap / TCP store, and the InfiniBand or RoCE adapters for the data path:
# set these to your site's names (ip link, ibv_devices).
# export NCCL_SOCKET_IFNAME=eth0
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7
# AMD Instinct (MI300X / MI308X): GPU-direct RDMA needs fine-grained PCIe memory for peer access.
if command -v rocm-smi >/dev/null 2>&1 || [ -d /opt/rocm ]; then
  export HSA_FORCE_FINE_GRAIN_PCIE=1
fi
# One CPU thread per rank for the host-side work; the GPUs do the rest.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
