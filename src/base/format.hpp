// Small formatting helpers shared by the broker's messages and the CLI: the public gpuipc/format.hpp.
#pragma once

#include "gpuipc/format.hpp"
