// hash_host_check.cpp - the host build of counter_hash.h, for tests/test_cuda_ext.py (no GPU needed).
//
// Reads queries from stdin, one a line, and prints one answer a line:
//   H counter key                      -> hash_counter(counter, key)
//   K seed model_id stream             -> stream_key(seed, model_id, stream)
//   R row col cols key                 -> rademacher_entry (+1 / -1)
//   N counter key_u1 key_u2            -> normal_entry (printed with 9 significant digits)
//   S counter key_row key_sign proj_dim -> "column negative" of the SJLT nonzero
#include <cinttypes>
#include <cstdio>

#include "counter_hash.h"

int main() {
  char op = 0;
  while (std::scanf(" %c", &op) == 1) {
    unsigned long long a = 0, b = 0, c = 0, d = 0;
    switch (op) {
      case 'H':
        if (std::scanf("%llu %llu", &a, &b) != 2) return 2;
        std::printf("%u\n", trakflow::hash_counter(a, static_cast<uint32_t>(b)));
        break;
      case 'K':
        if (std::scanf("%llu %llu %llu", &a, &b, &c) != 3) return 2;
        std::printf("%u\n", trakflow::stream_key(a, b, static_cast<uint32_t>(c)));
        break;
      case 'R':
        if (std::scanf("%llu %llu %llu %llu", &a, &b, &c, &d) != 4) return 2;
        std::printf("%d\n", static_cast<int>(trakflow::rademacher_entry(a, b, c, static_cast<uint32_t>(d))));
        break;
      case 'N':
        if (std::scanf("%llu %llu %llu", &a, &b, &c) != 3) return 2;
        std::printf("%.9g\n", static_cast<double>(trakflow::normal_entry(a, static_cast<uint32_t>(b),
                                                                          static_cast<uint32_t>(c))));
        break;
      case 'S':
        if (std::scanf("%llu %llu %llu %llu", &a, &b, &c, &d) != 4) return 2;
        std::printf("%u %d\n", trakflow::sjlt_column(a, static_cast<uint32_t>(b), d),
                    trakflow::sjlt_negative(a, static_cast<uint32_t>(c)) ? 1 : 0);
        break;
      default:
        return 3;
    }
  }
  return 0;
}
