// vroll-keygen: makes a ZeroMQ CURVE key pair for vroll-worker and its clients (Z85 text).
//
//   vroll-keygen worker      # writes worker.key (secret, mode 0600) and worker.pub
//   vroll-keygen trainer0    # then list trainer0.pub's key in the worker's --curve-trainer-keys
//
// Prints the public key on stdout.

#include <cstdio>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

#include "transport/curve.h"

int main(int argc, char** argv) {
  std::string name;
  bool force = false;
  CLI::App app{"vroll-keygen: make a CURVE key pair (NAME.key: secret, NAME.pub: public; Z85 text)"};
  app.add_option("name", name, "path prefix of the two files")->required();
  app.add_flag("--force", force, "overwrite existing files");
  CLI11_PARSE(app, argc, argv);
  try {
    const std::string base = std::filesystem::path(name).filename().string();
    if (base.empty() || base == "." || base == "..") {
      throw vroll::transport::TransportError("name '" + name + "' names no file (the keys go to NAME.key and NAME.pub)");
    }
    const std::string secret_path = name + ".key", public_path = name + ".pub";
    for (const std::string& path : {secret_path, public_path}) {
      if (!force && std::filesystem::exists(std::filesystem::symlink_status(path))) {  // a dangling link too
        throw vroll::transport::TransportError(path + " exists (use --force to overwrite)");
      }
    }
    const vroll::transport::CurveKeyPair keys = vroll::transport::GenerateCurveKeyPair();
    vroll::transport::WriteCurveKeyFile(secret_path, keys.secret_key, /*secret=*/true);
    vroll::transport::WriteCurveKeyFile(public_path, keys.public_key, /*secret=*/false);
    std::printf("%s\n", keys.public_key.c_str());
    std::fprintf(stderr, "wrote %s (secret) and %s (public)\n", secret_path.c_str(), public_path.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vroll-keygen: %s\n", e.what());
    return 1;
  }
  return 0;
}
