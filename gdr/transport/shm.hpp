/// \file
/// The shared-memory transport: endpoints between processes of one node,
/// through a ring each side writes and the other maps, woken through an
/// eventfd when asleep, with the peer's end seen on a Unix socket.
/// `shm::listener` / `shm::connect` make `shm::endpoint`s.
///
/// Headers:
///   * `shm/ring.hpp`        the ring and its segment layout, the wake-up flags;
///   * `shm/options.hpp`     the transport's tag, options and counters;
///   * `shm/connection.hpp`  the engine behind an endpoint, its members in `shm/io.hpp`;
///   * `shm/endpoint.hpp`    the endpoint;
///   * `shm/connect.hpp`     listen, accept, connect and the handshake.
#pragma once

#include <gdr/transport/shm/connect.hpp>
#include <gdr/transport/shm/connection.hpp>
#include <gdr/transport/shm/endpoint.hpp>
#include <gdr/transport/shm/io.hpp>
#include <gdr/transport/shm/options.hpp>
#include <gdr/transport/shm/ring.hpp>
