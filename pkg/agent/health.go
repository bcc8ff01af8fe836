package agent

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// Mux is the HTTP handler served on the metrics address; more handlers (such as /metrics) can
// be added before Run.
func (a *Agent) Mux() *http.ServeMux { return a.mux }

// paths lists what the mux serves, for the startup log: the health endpoints, and /metrics once
// the caller added it.
func (a *Agent) paths() []string {
	var out []string
	for _, p := range []string{"/metrics", "/healthz", "/readyz"} {
		if _, pattern := a.mux.Handler(&http.Request{Method: http.MethodGet, URL: &url.URL{Path: p}}); pattern != "" {
			out = append(out, p)
		}
	}
	return out
}

func (a *Agent) healthz(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintln(w, "ok")
}

// readiness tells whether /readyz answers 200, and if not why; a.mu held.
func (a *Agent) readiness() (bool, string) {
	switch {
	case !a.stats.Ready:
		return false, a.notReady
	case len(a.stats.Unenforced) > 0:
		return false, "the policy is not enforced everywhere: " + strings.Join(a.stats.Unenforced, ", ") + " (see the log)"
	case a.addrGone != "":
		return false, "a masquerade address of the configuration in force is not on the node: " + a.addrGone
	}
	return true, ""
}

func (a *Agent) readyz(w http.ResponseWriter, _ *http.Request) {
	a.mu.Lock()
	ready, why := a.readiness()
	a.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if !ready {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, "not ready:", why)
		return
	}
	fmt.Fprintln(w, "ok")
}
