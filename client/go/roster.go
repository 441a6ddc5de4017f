package kvix

import (
	"sync"

	"github.com/kvix/kvix/client/go/wire"
)

// roster is what this client knows of one server's worker names (docs/protocol.md,
// Roster): learnt from announces and listings, listed again from 0 when the server
// says ids were given to other names since.
type roster struct {
	mu       sync.RWMutex
	byName   map[string]uint32
	byID     map[uint32]string
	next     uint32
	reissued uint32
	listed   bool
	want     map[string]struct{} // names asked for and not known: listed by name
}

func (r *roster) init() { r.reset() }

func (r *roster) reset() {
	r.mu.Lock()
	r.byName, r.byID, r.next, r.listed = map[string]uint32{}, map[uint32]string{}, 0, false
	if r.want == nil {
		r.want = map[string]struct{}{}
	}
	r.mu.Unlock()
}

func (r *roster) learn(name string, id uint32) {
	r.mu.Lock()
	r.set(name, id)
	r.mu.Unlock()
}

func (r *roster) set(name string, id uint32) {
	if old, ok := r.byID[id]; ok && old != name {
		delete(r.byName, old)
	}
	if old, ok := r.byName[name]; ok && old != id {
		delete(r.byID, old)
	}
	r.byName[name], r.byID[id] = id, name
	delete(r.want, name)
}

func (r *roster) id(name string) (uint32, bool) {
	r.mu.RLock()
	id, ok := r.byName[name]
	r.mu.RUnlock()
	return id, ok
}

func (r *roster) name(id uint32) (string, bool) {
	r.mu.RLock()
	n, ok := r.byID[id]
	r.mu.RUnlock()
	return n, ok
}

// wantName remembers a name asked for and not known, to be listed by name.
func (r *roster) wantName(name string) {
	r.mu.Lock()
	if len(r.want) < 256 {
		r.want[name] = struct{}{}
	}
	r.mu.Unlock()
}

func (r *roster) wanted() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]string, 0, len(r.want))
	for n := range r.want {
		out = append(out, n)
	}
	return out
}

// stale says whether an answer's reissued count differs from the listing's.
func (r *roster) stale(reissued uint32) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.listed && reissued != r.reissued
}

func (r *roster) nextID(fromZero bool) uint32 {
	if fromZero {
		return 0
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.next
}

// page takes one Roster page; true when ids were reissued since the names were
// learnt, so that the roster must be listed again from 0.
func (r *roster) page(p *wire.Roster, first bool) (relist bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !first && r.listed && p.Reissued != r.reissued {
		r.byName, r.byID, r.next, r.listed = map[string]uint32{}, map[uint32]string{}, 0, false
		return true
	}
	if first && p.Reissued != r.reissued {
		r.byName, r.byID = map[string]uint32{}, map[uint32]string{}
	}
	for _, w := range p.Workers {
		r.set(w.Name, w.Worker)
	}
	r.next, r.reissued, r.listed = p.Next, p.Reissued, true
	return false
}
