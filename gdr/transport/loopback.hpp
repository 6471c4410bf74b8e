/// \file
/// The loopback transport: connected endpoint pairs inside one process, for
/// tests, examples and the quickstart (`gdr::loopback::make_pair`). See
/// `gdr/transport/loopback/endpoint.hpp`.
#pragma once

#include <gdr/transport/loopback/endpoint.hpp>
