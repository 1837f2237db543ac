// The simulator's c10/cuda/CUDAStream.h: kernels run when launched; there are no streams.
#pragma once

#include <cuda_runtime_api.h>
