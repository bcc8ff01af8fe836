package metrics

import (
	"context"
	_ "expvar" // registers /debug/vars on http.DefaultServeMux, as client_golang does in the agent
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/http/httptest"
	_ "net/http/pprof" // registers /debug/pprof/ on http.DefaultServeMux
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/configwatch"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
)

// TestEndpointsServeOnlyTheirPaths: the metrics address, wired as the agent command wires it
// (the agent's mux plus /metrics), answers /metrics, /healthz and /readyz, and 404 to every
// other path, the debug handlers among them, although this process has them registered on
// http.DefaultServeMux: the agent never serves that mux. Other methods than GET (and HEAD) are
// refused.
func TestEndpointsServeOnlyTheirPaths(t *testing.T) {
	rec := httptest.NewRecorder()
	http.DefaultServeMux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/debug/pprof/", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("the test needs the debug handlers registered in this process: /debug/pprof/ = %d", rec.Code)
	}

	b := &datapathtest.Backend{}
	src, err := configwatch.NewFile(filepath.Join(t.TempDir(), "none"), configwatch.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(agent.Options{Source: src, Backend: b})
	if err != nil {
		t.Fatal(err)
	}
	a.Mux().Handle("GET /metrics", Handler(newRegistry(t, Options{Backend: b, Agent: a}), nil))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx, ln) }()
	defer func() {
		cancel()
		<-done
	}()
	base := "http://" + ln.Addr().String()
	get := func(method, path string) (int, string) {
		t.Helper()
		req, err := http.NewRequest(method, base+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req) // follows redirects, e.g. of unclean paths
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if err := testutil.Poll(10*time.Second, 5*time.Millisecond, func() error {
		if code, body := get(http.MethodGet, "/readyz"); code != http.StatusOK {
			return testutil.NotYet("ready: %d %q", code, body)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	for path, want := range map[string]int{
		"/metrics": http.StatusOK, "/healthz": http.StatusOK, "/readyz": http.StatusOK,
		"/": http.StatusNotFound, "/debug/pprof/": http.StatusNotFound, "/debug/pprof/cmdline": http.StatusNotFound,
		"/debug/pprof/goroutine?debug=2": http.StatusNotFound, "/debug/pprof/profile?seconds=1": http.StatusNotFound,
		"/debug/vars": http.StatusNotFound, "/metrics/": http.StatusNotFound, "/healthz/x": http.StatusNotFound,
		"/readyz/": http.StatusNotFound, "/favicon.ico": http.StatusNotFound, "/metrics/../debug/vars": http.StatusNotFound,
		"//debug/pprof/": http.StatusNotFound, "/METRICS": http.StatusNotFound,
	} {
		code, body := get(http.MethodGet, path)
		if code != want {
			t.Errorf("GET %s = %d, want %d", path, code, want)
		}
		if code == http.StatusOK && path == "/metrics" && !strings.Contains(body, Namespace+"_build_info") {
			t.Errorf("/metrics does not serve the agent's metrics:\n%.300s", body)
		}
		// What pprof's index and goroutine dump and expvar's JSON contain.
		if strings.Contains(body, "Types of profiles available") || strings.Contains(body, "goroutine profile:") ||
			strings.Contains(body, `"memstats":`) {
			t.Errorf("GET %s serves debug data:\n%.300s", path, body)
		}
	}
	for _, method := range []string{http.MethodPost, http.MethodPut, http.MethodDelete, http.MethodPatch} {
		for _, path := range []string{"/metrics", "/healthz", "/readyz"} {
			if code, _ := get(method, path); code != http.StatusMethodNotAllowed {
				t.Errorf("%s %s = %d, want 405", method, path, code)
			}
		}
	}
	if code, _ := get(http.MethodHead, "/healthz"); code != http.StatusOK {
		t.Errorf("HEAD /healthz = %d", code)
	}
}

// TestNoDebugHandlers: the agent binary does not link net/http/pprof (nor x/net/trace), and no
// non-test code of the module registers handlers on, or serves, http.DefaultServeMux, where
// linked packages (expvar, through client_golang) put theirs. A debug endpoint would need a
// flag that asks for it; there is none (see pkg/cli's TestNoDebugFlags).
func TestNoDebugHandlers(t *testing.T) {
	root := filepath.Join("..", "..")
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", filepath.Join(root, "cmd", "ip-masq-agent")).CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	deps := strings.Fields(string(out))
	if len(deps) < 50 {
		t.Fatalf("go list found only %d packages: %v", len(deps), deps)
	}
	for _, d := range deps {
		if d == "net/http/pprof" || d == "golang.org/x/net/trace" {
			t.Errorf("the agent binary links %s", d)
		}
	}

	banned := map[string]bool{"DefaultServeMux": true, "Handle": true, "HandleFunc": true,
		"ListenAndServe": true, "ListenAndServeTLS": true, "Serve": true, "ServeTLS": true}
	files := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata" || d.Name() == "headers") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		files++
		httpName := ""
		for _, imp := range f.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			switch p {
			case "net/http/pprof", "expvar", "golang.org/x/net/trace":
				t.Errorf("%s imports %s", path, p)
			case "net/http":
				httpName = "http"
				if imp.Name != nil {
					httpName = imp.Name.Name
				}
			}
		}
		if httpName == "" {
			return nil
		}
		ast.Inspect(f, func(n ast.Node) bool {
			sel, ok := n.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			if id, ok := sel.X.(*ast.Ident); ok && id.Name == httpName && banned[sel.Sel.Name] {
				t.Errorf("%s uses http.%s: the global mux, where debug handlers live", path, sel.Sel.Name)
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files < 20 {
		t.Fatalf("checked only %d files", files)
	}
}
