// Tokenizer tests against independent oracles: ids that upstream run.c's bpe_encode produces for
// tok512, the reference greedy run of stories260K, and UTF-8 byte values written by hand.
#include "policy/tokenizer.h"

#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/support/reference_data.h"
#include "tests/support/test_paths.h"

namespace vroll::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using vroll::testing::ReadBytes;

constexpr TokenId kSpace = 410;  // tok512's " " piece: the dummy prefix

Tokenizer LoadTok512() { return Tokenizer::LoadLlama2c(testing::SharedPath("models/tok512.bin"), 512); }

TEST(TokenizerTest, LoadsTok512) {
  VROLL_REQUIRE_SHARED();
  const Tokenizer tok = LoadTok512();
  EXPECT_EQ(tok.vocab_size(), 512);
  EXPECT_EQ(tok.max_token_length(), 7);
  EXPECT_EQ(tok.piece(0), "<unk>");
  EXPECT_EQ(tok.piece(Tokenizer::kBos), "\n<s>\n");
  EXPECT_EQ(tok.piece(Tokenizer::kEos), "\n</s>\n");
  EXPECT_EQ(tok.piece(3), "<0x00>");
  EXPECT_EQ(tok.piece(258), "<0xFF>");
  EXPECT_EQ(tok.piece(403), " Once");
  EXPECT_EQ(tok.piece(kSpace), " ");
}

TEST(TokenizerTest, EncodesOnceUponATimeAsRunC) {
  VROLL_REQUIRE_SHARED();
  const Tokenizer tok = LoadTok512();
  EXPECT_THAT(tok.Encode("Once upon a time", /*add_bos=*/true, /*add_eos=*/false), ElementsAre(1, 403, 407, 261, 378));
  EXPECT_THAT(tok.Encode("Once upon a time", /*add_bos=*/false, /*add_eos=*/true), ElementsAre(403, 407, 261, 378, 2));
}

// Expected ids: karpathy/llama2.c run.c (commit bd182289) bpe_encode, copied verbatim into a
// small C harness and run on tok512.bin; its output always starts with the dummy prefix.
struct RunCCase {
  std::string text;
  std::vector<TokenId> ids;
};

TEST(TokenizerTest, EncodeMatchesRunCBpeEncode) {
  VROLL_REQUIRE_SHARED();
  const Tokenizer tok = LoadTok512();
  const std::vector<RunCCase> cases = {
      {"Once upon a time, there was a little girl named Lily.",
       {403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426}},
      {"Hello, World!\nHow are you?\n\n", {346, 306, 414, 432, 410, 448, 304, 341, 443, 13, 440, 327, 261, 276, 364, 450, 13, 13}},
      {"The cat sat on the mat. It's 3:45pm -- time for tea & cake; yes/no?",
       {291, 280, 294, 262, 294, 353, 265, 284, 294, 426, 359, 413, 439, 419, 410, 472, 467, 484, 480, 427, 423,
        410, 464, 464, 378, 387, 259, 411, 412, 410, 499, 280, 412, 354, 474, 348, 406, 492, 416, 414, 450}},
      // "é" is a tok512 piece (485); "ö", "✓", "日本" and "🙂" fall back to their UTF-8 bytes + 3.
      {"h\u00e9llo w\u00f6rld \u2713 \u65e5\u672c \U0001F642",
       {270, 485, 306, 414, 263, 0xC3 + 3, 0xB6 + 3, 420, 341, 410, 0xE2 + 3, 0x9C + 3, 0x93 + 3, 410, 0xE6 + 3,
        0x97 + 3, 0xA5 + 3, 0xE6 + 3, 0x9C + 3, 0xAC + 3, 410, 0xF0 + 3, 0x9F + 3, 0x99 + 3, 0x82 + 3}},
      {"  two  spaces  ", {410, 410, 259, 424, 414, 410, 262, 427, 412, 331, 419, 410, 410}},
      // Stray continuation bytes group as one lookup; a truncated lead byte falls back alone.
      {"\x80\x80" "abc\xc3", {410, 0x80 + 3, 0x80 + 3, 412, 430, 429, 0xC3 + 3}},
  };
  for (const RunCCase& c : cases) {
    EXPECT_THAT(tok.Encode(c.text, /*add_bos=*/false, /*add_eos=*/false), ElementsAreArray(c.ids)) << c.text;
  }
}

TEST(TokenizerTest, EmptyTextHasNoDummyPrefix) {
  VROLL_REQUIRE_SHARED();
  const Tokenizer tok = LoadTok512();
  EXPECT_THAT(tok.Encode("", /*add_bos=*/true, /*add_eos=*/true), ElementsAre(1, 2));
  EXPECT_THAT(tok.Encode("", /*add_bos=*/false, /*add_eos=*/false), ElementsAre());
  EXPECT_EQ(tok.Decode({}), "");
  EXPECT_EQ(tok.Decode({Tokenizer::kBos}), "");
}

TEST(TokenizerTest, DecodeInvertsEncode) {
  VROLL_REQUIRE_SHARED();
  const Tokenizer tok = LoadTok512();
  const std::vector<std::string> texts = {
      "",
      "a",
      " ",
      "Once upon a time",
      "Hello, World!\nHow are you?\n\n",
      "\n\nleading newlines and a tab\there",
      "  two  spaces  ",
      "Punctuation: ()[]{}<>!?;:'\"`~@#$%^&*-_=+\\|/.,",
      "<0x41> is not a byte token in text",
      "h\u00e9llo w\u00f6rld \u2713 \u65e5\u672c \U0001F642 \u0416\u0436",
      std::string("embedded\0nul", 12),
      "\x80\x80" "abc\xc3",
      ReadBytes(testing::SharedPath("reference/stories260K_greedy_n200.txt")),
  };
  for (const std::string& text : texts) {
    const std::vector<TokenId> ids = tok.Encode(text, /*add_bos=*/true, /*add_eos=*/false);
    EXPECT_EQ(tok.Decode(ids), text) << "text: " << text;
    // Without the BOS the first token still counts as following BOS.
    EXPECT_EQ(tok.Decode(std::vector<TokenId>(ids.begin() + 1, ids.end())), text) << "text: " << text;
  }
}

// The reference run starts from BOS and picks the 200 ids in the third column. run.c prints each
// pick's piece, then one final "\n" after the loop: the .txt file holds exactly that (465 bytes,
// ending in a "\n" that no token produced), so Decode(ids) is the file minus that last byte: the
// 464 bytes of llama2.c test_all.py's expected_stdout.
TEST(TokenizerTest, DecodesReferenceGreedyRunByteForByte) {
  VROLL_REQUIRE_SHARED();
  const Tokenizer tok = LoadTok512();
  std::ifstream ids_file(testing::SharedPath("reference/stories260K_greedy_n200_ids.txt"));
  ASSERT_TRUE(ids_file);
  std::vector<TokenId> chosen;
  int step = 0;
  int input = 0;
  int pick = 0;
  while (ids_file >> step >> input >> pick) {
    if (step == 0) {
      EXPECT_EQ(input, Tokenizer::kBos);
    } else {
      EXPECT_EQ(input, chosen.back()) << "step " << step;
    }
    chosen.push_back(pick);
  }
  ASSERT_EQ(chosen.size(), 200u);

  const std::string expected = ReadBytes(testing::SharedPath("reference/stories260K_greedy_n200.txt"));
  ASSERT_EQ(expected.size(), 465u);
  ASSERT_EQ(expected.back(), '\n');
  EXPECT_EQ(tok.Decode(chosen) + "\n", expected);
  EXPECT_EQ(tok.Decode(chosen).size(), 464u);
  chosen.insert(chosen.begin(), Tokenizer::kBos);
  EXPECT_EQ(tok.Decode(chosen) + "\n", expected);

  // Piece by piece, as a streaming caller decodes.
  std::string streamed;
  for (size_t i = 1; i < chosen.size(); ++i) streamed += tok.DecodePiece(chosen[i - 1], chosen[i]);
  EXPECT_EQ(streamed + "\n", expected);
}

TEST(TokenizerTest, DecodePieceFollowsRunC) {
  VROLL_REQUIRE_SHARED();
  const Tokenizer tok = LoadTok512();
  EXPECT_EQ(tok.DecodePiece(Tokenizer::kBos, 403), "Once");  // leading space stripped after BOS
  EXPECT_EQ(tok.DecodePiece(378, 403), " Once");
  EXPECT_EQ(tok.DecodePiece(378, 'A' + 3), "A");  // "<0x41>"
  EXPECT_EQ(tok.DecodePiece(378, '\n' + 3), "\n");
  EXPECT_EQ(tok.DecodePiece(378, 3), std::string(1, '\0'));
  EXPECT_EQ(tok.DecodePiece(378, 0xFF + 3), "\xFF");
  EXPECT_EQ(tok.DecodePiece(Tokenizer::kBos, ' ' + 3), " ");  // a byte token is never stripped
  EXPECT_EQ(tok.DecodePiece(378, Tokenizer::kBos), "");
  EXPECT_EQ(tok.DecodePiece(378, Tokenizer::kEos), "\n</s>\n");
  EXPECT_EQ(tok.Decode({403, Tokenizer::kBos, 403}), "OnceOnce");  // BOS starts a new text
  EXPECT_THROW(tok.DecodePiece(378, -1), std::out_of_range);
  EXPECT_THROW(tok.DecodePiece(378, 512), std::out_of_range);
}

TEST(TokenizerTest, ByteLevelRoundTripsRandomBytes) {
  const Tokenizer tok = Tokenizer::ByteLevel();
  ASSERT_EQ(tok.vocab_size(), 259);
  EXPECT_EQ(tok.piece(1), "<s>");
  EXPECT_EQ(tok.piece(3 + 0xAB), "<0xAB>");
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> byte(0, 255);
  for (int length : {0, 1, 2, 7, 100, 1000}) {
    std::string text;
    for (int i = 0; i < length; ++i) text.push_back(static_cast<char>(byte(rng)));
    std::vector<TokenId> expected = {Tokenizer::kBos};
    for (unsigned char b : text) expected.push_back(b + 3);
    expected.push_back(Tokenizer::kEos);
    const std::vector<TokenId> ids = tok.Encode(text, /*add_bos=*/true, /*add_eos=*/true);
    EXPECT_EQ(ids, expected) << "length " << length;
    EXPECT_EQ(tok.Decode(std::vector<TokenId>(ids.begin(), ids.end() - 1)), text) << "length " << length;
  }
  EXPECT_EQ(tok.Encode("<s>", false, false), (std::vector<TokenId>{'<' + 3, 's' + 3, '>' + 3}));
}

}  // namespace
}  // namespace vroll::policy
