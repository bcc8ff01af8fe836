package metrics

import (
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/cache"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	certutil "k8s.io/client-go/util/cert"
)

// Path is where the metrics are served, and the non-resource URL a scraper must be allowed to
// get when they are protected (see Protect).
const Path = "/metrics"

// How long the API server's answers are kept, as kube-rbac-proxy and controller-runtime keep
// them (one scrape every interval then costs no review once the first is answered), how many,
// and how long a review may take.
const (
	allowTTL      = 2 * time.Minute
	denyTTL       = 10 * time.Second
	cachedAnswers = 1024
	reviewTimeout = 10 * time.Second
)

// Protect wraps h so that it serves only clients the API server of cfg vouches for, as
// Kubernetes components serve their metrics (controller-runtime's metrics filter,
// kube-rbac-proxy): the request's bearer token must pass a TokenReview (else 401 Unauthorized),
// and its user must be allowed to get the non-resource URL of the request's path by a
// SubjectAccessReview (else 403 Forbidden); when the API server cannot answer, 500. Answers are
// cached: an allowed one for allowTTL, a refusal for denyTTL. The agent's service account needs to
// create tokenreviews and subjectaccessreviews (deploy/rbac/metrics).
//
// The reviews are client-go's typed calls rather than k8s.io/apiserver's delegating
// authenticator and authorizer: those link gRPC and with it golang.org/x/net/trace, whose debug
// handlers the agent binary must not carry (TestNoDebugHandlers).
func Protect(h http.Handler, cfg *rest.Config, log *slog.Logger) (http.Handler, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	g := &gate{next: h, client: client, log: log.With("component", "metrics"), answers: cache.NewLRUExpireCache(cachedAnswers)}
	return g, nil
}

// gate is the handler Protect returns.
type gate struct {
	next    http.Handler
	client  kubernetes.Interface
	log     *slog.Logger
	answers *cache.LRUExpireCache // answerKey -> answer
}

// answer is the API server's word on a token and a request: the status to refuse the request
// with (0 serves it), and the token's user.
type answer struct {
	code int
	user string
}

func (g *gate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	verb := "get" // HEAD is a get, as the API server's request info has it
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		verb = strings.ToLower(r.Method)
	}
	token, ok := bearerToken(r)
	if !ok {
		refuse(w, http.StatusUnauthorized, "Unauthorized")
		return
	}
	sum := sha256.Sum256([]byte(token))
	key := hex.EncodeToString(sum[:]) + " " + verb + " " + r.URL.Path
	a, cached := g.answers.Get(key)
	if !cached {
		ctx, cancel := context.WithTimeout(r.Context(), reviewTimeout)
		defer cancel()
		ans, err := g.review(ctx, token, verb, r.URL.Path)
		if err != nil {
			g.log.Warn("scrape refused: the API server did not review it", "remote", r.RemoteAddr, "error", err)
			refuse(w, http.StatusInternalServerError, "The API server did not review the request")
			return
		}
		ttl := denyTTL
		if ans.code == 0 {
			ttl = allowTTL
		}
		g.answers.Add(key, ans, ttl)
		a = ans
	}
	switch ans := a.(answer); ans.code {
	case 0:
		g.next.ServeHTTP(w, r)
	case http.StatusForbidden:
		refuse(w, ans.code, fmt.Sprintf("Forbidden: user %q may not %s %s", ans.user, verb, r.URL.Path))
	default:
		refuse(w, ans.code, http.StatusText(ans.code))
	}
}

// review asks the API server who the token is (TokenReview) and whether that user may do verb
// on the non-resource URL path (SubjectAccessReview).
func (g *gate) review(ctx context.Context, token, verb, path string) (answer, error) {
	tr, err := g.client.AuthenticationV1().TokenReviews().Create(ctx,
		&authenticationv1.TokenReview{Spec: authenticationv1.TokenReviewSpec{Token: token}}, metav1.CreateOptions{})
	if err != nil {
		return answer{}, fmt.Errorf("token review: %w", err)
	}
	if !tr.Status.Authenticated {
		return answer{code: http.StatusUnauthorized}, nil
	}
	u := tr.Status.User
	extra := make(map[string]authorizationv1.ExtraValue, len(u.Extra))
	for k, v := range u.Extra {
		extra[k] = authorizationv1.ExtraValue(v)
	}
	sar, err := g.client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
		Spec: authorizationv1.SubjectAccessReviewSpec{User: u.Username, UID: u.UID, Groups: u.Groups, Extra: extra,
			NonResourceAttributes: &authorizationv1.NonResourceAttributes{Path: path, Verb: verb}},
	}, metav1.CreateOptions{})
	if err != nil {
		return answer{}, fmt.Errorf("subject access review of %s: %w", u.Username, err)
	}
	if !sar.Status.Allowed || sar.Status.Denied {
		return answer{code: http.StatusForbidden, user: u.Username}, nil
	}
	return answer{user: u.Username}, nil
}

// bearerToken is the token of the request's "Authorization: Bearer" header.
func bearerToken(r *http.Request) (string, bool) {
	scheme, token, ok := strings.Cut(strings.TrimSpace(r.Header.Get("Authorization")), " ")
	token = strings.TrimSpace(token)
	return token, ok && strings.EqualFold(scheme, "bearer") && token != ""
}

// refuse answers a refused request with its code and a line of text.
func refuse(w http.ResponseWriter, code int, text string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	fmt.Fprintln(w, text)
}

// TLSConfig is the serving configuration of the metrics endpoint: the certificate and key of
// the PEM files when named (both or neither), else a self-signed certificate made now, in
// memory, for the host's name (scrapers then skip verification, as Prometheus does of a
// kubelet's).
func TLSConfig(certFile, keyFile string) (*tls.Config, error) {
	if (certFile == "") != (keyFile == "") {
		return nil, fmt.Errorf("a certificate needs its key and a key its certificate (got %q and %q)", certFile, keyFile)
	}
	var cert tls.Certificate
	var err error
	if certFile != "" {
		cert, err = tls.LoadX509KeyPair(certFile, keyFile)
	} else {
		host, _ := os.Hostname()
		var certPEM, keyPEM []byte
		certPEM, keyPEM, err = certutil.GenerateSelfSignedCertKey(cmp.Or(host, "ip-masq-agent"), nil, nil)
		if err == nil {
			cert, err = tls.X509KeyPair(certPEM, keyPEM)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("serving certificate: %w", err)
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}, nil
}
