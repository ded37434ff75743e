"""The server's error answers (OpenAI's error body) and the marker of an integer too long to convert: imported by
protocol.py and the modules protocol.py calls (structured.py) alike."""
from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


class HugeInt:
    """What parse_json puts where the body has an integer too long for Python to convert (4300+ digits):
    any field that is one answers a 400 naming it; an ignored field may be one."""
    MAX_DIGITS = 4000

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"
