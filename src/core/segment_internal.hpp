// Segment creation with broker flags, for the objects built on segments (Semaphore, Channel).
#pragma once

#include "gpuipc/segment.hpp"
#include "proto/shm.hpp"
