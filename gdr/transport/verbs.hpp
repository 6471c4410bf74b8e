/// \file
/// The verbs transport: endpoints over RDMA RC queue pairs (rdma-core),
/// set up through librdmacm, on the protocol layer. Needs `//gdr:verbs`
/// (`GDR_HAS_VERBS`).
///
/// Headers, by lifecycle phase (as NCCL's net_ib is split):
///   * `verbs/completion.hpp`  devices as a scheduler uses them: protection
///                             domain, completion channel and queue, polled
///                             by the scheduler (`cq_poller`);
///   * `verbs/connect.hpp`     connection set-up: `connect`, `listener`;
///   * `verbs/memory.hpp`      registration of memory, caches;
///   * `verbs/connection.hpp`  the connection: one RC queue pair under the
///                             protocol engine, by phase (wire, recv,
///                             grants, send, rdma_read, liveness);
///   * `verbs/options.hpp`     the tag, the endpoint's options and counters;
///   * `verbs/gpudirect.hpp`   the GPUDirect probe of a (GPU, NIC) pair,
///                             dma-buf registration of GPU memory;
///   * `verbs/flush.hpp`       the GPUDirect flush's loopback queue pair;
///   * `verbs/probe.hpp`       the node's RDMA devices and whether GPUDirect
///                             is possible there;
///   * `verbs/endpoint.hpp`    the endpoint and its rows of the path table.
#pragma once

#include <gdr/transport/verbs/completion.hpp>
#include <gdr/transport/verbs/connect.hpp>
#include <gdr/transport/verbs/connection.hpp>
#include <gdr/transport/verbs/endpoint.hpp>
#include <gdr/transport/verbs/flush.hpp>
#include <gdr/transport/verbs/gpudirect.hpp>
#include <gdr/transport/verbs/memory.hpp>
#include <gdr/transport/verbs/options.hpp>
#include <gdr/transport/verbs/probe.hpp>
