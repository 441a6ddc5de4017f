package wire

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/zeebo/xxh3"
)

// The chain hash's golden vectors (wire/tests/golden/chain_v1.txt, written by
// wire/tests/golden.rs from the same inputs as here).
func goldenChains() string {
	out := fmt.Sprintf("# kvix chain hash golden vectors, chain hash version %d\n", ChainHashVersion)
	tokens := make([]uint32, 64)
	for i := range tokens {
		tokens[i] = uint32(i) * 2_654_435_761 % 152_000
	}
	raw := make([]byte, 600)
	for i := range raw {
		raw[i] = byte(i * 31 % 251)
	}
	base := TokensKeyspace("meta-llama/Llama-3.1-8B")
	keyspaces := []struct {
		name string
		ks   Keyspace
	}{
		{"base", base},
		{"lora", Keyspace{Model: base.Model, Lora: "sql-adapter"}},
		{"salted", Keyspace{Model: base.Model, Salt: "tenant-42"}},
		{"bytes", Keyspace{Model: base.Model, Kind: ChunkBytes}},
		{"empty", Keyspace{}},
	}
	for _, block := range []uint32{16, 32} {
		for _, k := range keyspaces {
			seed := k.ks.Seed(block)
			out += fmt.Sprintf("seed/%s/b%d %016x\n", k.name, block, seed)
			var chain []uint64
			if k.ks.Kind == ChunkBytes {
				chain = ByteChain(seed, ByteChunk, raw)
			} else {
				chain = TokenChain(seed, block, tokens)
			}
			for i, h := range chain {
				out += fmt.Sprintf("chain/%s/b%d/%d %016x\n", k.name, block, i, h)
			}
		}
		extras := [][]ExtraKey{
			nil,
			{{Form: ExtraMultimodal, Identifier: "img-7f3a", Offset: -3}},
			nil,
			{{Form: ExtraBytes, Bytes: []byte{0xde, 0xad, 0xbe, 0xef}}, {Form: ExtraText, Text: "k"},
				{Form: ExtraInt, Int: -2}},
		}
		long := make([]uint32, 8*block)
		for i := range long {
			long[i] = uint32(i)*7 + 1
		}
		for i, h := range TokenChainWithExtras(base.Seed(block), block, 2*block, long, extras) {
			out += fmt.Sprintf("extras/b%d/%d %016x\n", block, i, h)
		}
	}
	return out
}

func TestChainHashesMatchTheGoldenFile(t *testing.T) {
	pinned, err := os.ReadFile("../../../wire/tests/golden/chain_v1.txt")
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Split(string(pinned), "\n")
	got := strings.Split(goldenChains(), "\n")
	for i := range want {
		if i >= len(got) || got[i] != want[i] {
			t.Fatalf("line %d: got %q, want %q", i+1, got[min(i, len(got)-1)], want[i])
		}
	}
	if len(got) != len(want) {
		t.Fatalf("%d lines, the golden file has %d", len(got), len(want))
	}
}

func TestTheXXH3PrimitiveIsThePublishedOne(t *testing.T) {
	if h := xxh3.Hash(nil); h != 0x2D06_8005_38D3_94C2 {
		t.Fatalf("xxh3 of nothing is %x", h)
	}
}

func TestPartialBlocksAreNotHashedAndChainsExtend(t *testing.T) {
	tokens := make([]uint32, 40)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	whole := TokenChain(7, 16, tokens)
	if len(whole) != 2 {
		t.Fatalf("%d hashes for 40 tokens of 16-token blocks", len(whole))
	}
	if next := TokenChain(whole[0], 16, tokens[16:32]); next[0] != whole[1] {
		t.Fatal("a chain does not continue from its last hash")
	}
}

func TestTheInPlaceChainIsThePortableOne(t *testing.T) {
	tokens := make([]uint32, 1000)
	for i := range tokens {
		tokens[i] = uint32(i) * 2_654_435_761
	}
	for _, block := range []uint32{1, 16, 32, 999} {
		a := AppendTokenChain(nil, 42, block, tokens)
		b := appendTokenChainPortable(nil, 42, block, tokens)
		if len(a) != len(b) || len(a) != len(tokens)/int(block) {
			t.Fatalf("block %d: %d and %d hashes", block, len(a), len(b))
		}
		for i := range a {
			if a[i] != b[i] {
				t.Fatalf("block %d: hash %d differs", block, i)
			}
		}
	}
}
