/// \file
/// The TCP transport: endpoints over TCP sockets driven by the scheduler's
/// io_uring. `tcp::listener` / `tcp::connect` make `tcp::endpoint`s; the
/// wire format is documented in `gdr/transport/tcp/frame.hpp`.
///
/// Headers, by lifecycle phase:
///   * `tcp/socket.hpp`    addresses, the socket handle, socket options;
///   * `tcp/listener.hpp`  listen and accept;
///   * `tcp/connect.hpp`   connect;
///   * `tcp/frame.hpp`     the wire format and its parser;
///   * `tcp/endpoint.hpp`  the endpoint (send, recv, put, get, close);
///   * `tcp/options.hpp`   the transport's tag, options and counters;
///   * `tcp/connection.hpp` the engine behind it, its members in
///     `tcp/writer.hpp`, `tcp/reader.hpp` and `tcp/close.hpp`.
#pragma once

#include <gdr/transport/tcp/connect.hpp>
#include <gdr/transport/tcp/close.hpp>
#include <gdr/transport/tcp/connection.hpp>
#include <gdr/transport/tcp/endpoint.hpp>
#include <gdr/transport/tcp/frame.hpp>
#include <gdr/transport/tcp/listener.hpp>
#include <gdr/transport/tcp/options.hpp>
#include <gdr/transport/tcp/reader.hpp>
#include <gdr/transport/tcp/socket.hpp>
#include <gdr/transport/tcp/writer.hpp>
