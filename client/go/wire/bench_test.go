package wire

import "testing"

func BenchmarkTokenChain20k(b *testing.B) {
	tokens := make([]uint32, 20_000)
	for i := range tokens {
		tokens[i] = uint32(i * 7919 % 131072)
	}
	seed := TokensKeyspace("m").Seed(16)
	b.SetBytes(int64(4 * len(tokens)))
	var out []uint64
	for i := 0; i < b.N; i++ {
		out = AppendTokenChain(out[:0], seed, 16, tokens)
	}
}

func BenchmarkEncodeTieredQuery1250(b *testing.B) {
	q := &TieredQuery{Query: Query{Keyspace: TokensKeyspace("m"), Chain: make([]uint64, 1250)}, Weights: WeightsDynamo}
	var buf []byte
	for i := 0; i < b.N; i++ {
		buf, _ = Append(buf[:0], q, 1, 0)
	}
}
