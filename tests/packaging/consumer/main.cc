// Uses an installed vroll through vroll::transport only: builds a transport::Client, encodes a
// generate request with the wire codec and decodes it back. Needs no worker and no network.
#include <cstdio>
#include <string>
#include <variant>

#include "rollout/request.h"
#include "transport/client.h"
#include "transport/protocol.h"

int main() {
  vroll::transport::Client client;
  vroll::rollout::Request request;
  request.request_id = "q1";
  request.prompt = {1, 403, 407};
  request.n = 4;
  request.seed = 7;
  const std::string header = vroll::transport::EncodeClientMessage(
      vroll::transport::GenerateMsg{client.NextId("g"), request});
  const auto decoded = vroll::transport::DecodeClientMessage(header.data(), header.size());
  if (!decoded.ok()) {
    std::fprintf(stderr, "decode failed: %s\n", decoded.error.message.c_str());
    return 1;
  }
  const auto* generate = std::get_if<vroll::transport::GenerateMsg>(&*decoded.message);
  if (generate == nullptr || generate->request.request_id != "q1" || generate->request.n != 4 ||
      generate->request.prompt != request.prompt) {
    std::fprintf(stderr, "round trip changed the request\n");
    return 1;
  }
  std::printf("vroll consumer ok: %s, %zu header bytes\n", vroll::transport::TypeName(*decoded.message),
              header.size());
  return 0;
}
