/// \file
/// The umbrella header: `#include <gdr/gdr.hpp>` gives the whole public API
/// this build has. Every public header is listed here explicitly (each one
/// also compiles alone). CUDA and verbs parts come with `GDR_HAS_CUDA` /
/// `GDR_HAS_VERBS` (the //gdr:cuda and //gdr:verbs targets set them). The MPI
/// bootstrap needs Open MPI: include <gdr/bootstrap/mpi.hpp> yourself
/// (//gdr:mpi).
#pragma once

#include <gdr/config.hpp>
#include <gdr/error.hpp>

// Coroutines
#include <gdr/coro/cancel.hpp>
#include <gdr/coro/scope.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/timeout.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/coro/when_any.hpp>

// The scheduler
#include <gdr/sched/operation.hpp>
#include <gdr/sched/poller.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/sched/stop_token.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/sched/uring_op.hpp>

// Memory
#include <gdr/memory/access.hpp>
#include <gdr/memory/buffer.hpp>
#include <gdr/memory/copy.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/memory/registration_cache.hpp>
#include <gdr/memory/remote_view.hpp>
#include <gdr/memory/resource.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/memory/view.hpp>

// Transports
#include <gdr/protocol/endpoint.hpp>
#include <gdr/protocol/engine.hpp>
#include <gdr/protocol/message.hpp>
#include <gdr/protocol/options.hpp>
#include <gdr/transfer/address.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transport/loopback.hpp>
#include <gdr/transfer/path.hpp>
#include <gdr/transport/tcp.hpp>
#include <gdr/transport/shm.hpp>

// Bootstrap
#include <gdr/bootstrap/lazy_mesh.hpp>
#include <gdr/bootstrap/mesh.hpp>
#include <gdr/bootstrap/rendezvous.hpp>
#include <gdr/bootstrap/tcp_rendezvous.hpp>

#if GDR_HAS_CUDA
#include <gdr/memory/cuda_copy.hpp>
#include <gdr/cuda/device.hpp>
#include <gdr/cuda/error.hpp>
#include <gdr/cuda/event_poller.hpp>
#include <gdr/cuda/stream.hpp>
#endif

#if GDR_HAS_VERBS
#include <gdr/transport/verbs.hpp>
#include <gdr/transport/verbs/completion.hpp>
#include <gdr/transport/verbs/connect.hpp>
#include <gdr/transport/verbs/connection.hpp>
#include <gdr/transport/verbs/endpoint.hpp>
#include <gdr/transport/verbs/flush.hpp>
#include <gdr/transport/verbs/gpudirect.hpp>
#include <gdr/transport/verbs/memory.hpp>
#include <gdr/transport/verbs/options.hpp>
#include <gdr/transport/verbs/probe.hpp>
#endif
