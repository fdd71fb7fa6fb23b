// m3rt/m3rt.h — the whole public API in one include.
#pragma once

#include "m3rt/dtype.h"
#include "m3rt/error.h"
#include "m3rt/lightning_indexer.h"
#include "m3rt/msa_attention.h"
#include "m3rt/ops.h"
#include "m3rt/tensor.h"
